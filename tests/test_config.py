"""Run configuration: our JSON sections (parallelism, memory, kernels), batch arithmetic, scheduler 'auto' values, and
unknown keys refused with the nearest valid name. The shipped ds_configs/*.json: tests/test_ds_configs.py."""
import pytest
from helpers.training import write_ds_config

from recipe.config import BatchPlan, KernelOptions, load_run_config, resolve_batch, resolve_scheduler
from recipe.config_keys import ConfigError, deepspeed_top_level_keys
from recipe.config_memory import MemoryOptions
from recipe.parallel.dims import ParallelDims


def test_memory_section_parsed_and_removed():
    cfg = {"train_batch_size": 4, "memory": {"loss_chunk_size": 512, "checkpoint_ttt_steps": True}}
    opts = MemoryOptions.pop_from(cfg, "x.json")
    assert opts == MemoryOptions(loss_chunk_size=512, checkpoint_ttt_steps=True, attention_tile_size=1024)
    assert "memory" not in cfg
    assert MemoryOptions.pop_from({}, "x.json") == MemoryOptions(None, False, 1024)  # tiled attention by default
    dense = MemoryOptions.pop_from({"memory": {"attention_tile_size": None}}, "x.json")
    assert dense.attention_tile_size is None
    assert MemoryOptions.pop_from({"memory": {"attention_tile_size": 256}}, "x.json").attention_tile_size == 256
    assert MemoryOptions.pop_from({}, "x.json").sparse_anchors == "auto"  # sparse where it pays
    for mode in (True, False, "auto", "auto:cpu", "auto:h200"):
        assert MemoryOptions.pop_from({"memory": {"sparse_anchors": mode}}, "x.json").sparse_anchors == mode
    every = {k: "auto" for k in ("loss_chunk_size", "checkpoint_ttt_steps", "attention_tile_size", "mlp_tile_size",
                                 "teacher_logits_once")}
    auto = MemoryOptions.pop_from({"memory": every}, "x.json")
    assert auto == MemoryOptions(**every) and not auto.resolved
    assert set(auto.auto_switches) == set(every)


def test_kernels_section_parsed_and_removed():
    cfg = {"train_batch_size": 4, "kernels": {"attention": "sdpa", "_comment": "the fused CPU kernel"}}
    assert KernelOptions.pop_from(cfg, "x.json") == KernelOptions(attention="sdpa")
    assert "kernels" not in cfg
    assert KernelOptions.pop_from({}, "x.json").attention == "auto"
    assert KernelOptions.pop_from({"kernels": None}, "x.json").attention == "auto"


@pytest.mark.parametrize("section, message", [
    ({"attention": "flash"}, "'kernels.attention' must be one of ['auto', 'tiled', 'sdpa', 'flex'], got 'flash'"),
    ({"atention": "flex"}, "unknown key(s) ['atention'] in 'kernels'; did you mean 'attention'?"),
    ({"attention_backend": "flex"}, "unknown key(s) ['attention_backend'] in 'kernels'; did you mean 'attention'?"),
    (["flex"], "'kernels' must be an object like {\"attention\": \"auto\"}"),
])
def test_kernels_section_errors_name_file_and_field(section, message):
    with pytest.raises(ConfigError) as err:
        KernelOptions.pop_from({"kernels": section}, "cfg.json")
    assert str(err.value).startswith("cfg.json: ") and message in str(err.value)


@pytest.mark.parametrize("section, message", [
    ({"loss_chunk": 4}, "unknown key(s) ['loss_chunk']"),
    ({"loss_chunk_size": 0}, "memory.loss_chunk_size' must be a positive integer, null or \"auto\", got 0"),
    ({"loss_chunk_size": True}, "memory.loss_chunk_size' must be a positive integer, null or \"auto\""),
    ({"argmax_chunk_size": "auto"}, "memory.argmax_chunk_size' must be a positive integer or null, got 'auto'"),
    ({"checkpoint_ttt_steps": "yes"}, "memory.checkpoint_ttt_steps' must be true, false or \"auto\", got 'yes'"),
    ({"teacher_logits_once": 1}, "memory.teacher_logits_once' must be true, false or \"auto\", got 1"),
    ({"sparse_anchors": "on"}, "memory.sparse_anchors' must be one of false, true, \"auto\", \"auto:cpu\", "
                               "\"auto:h200\", got 'on'"),
    ({"sparse_anchors": 1}, "memory.sparse_anchors' must be one of false, true, \"auto\""),
    ({"sparse_anchors": "auto:tpu"}, "memory.sparse_anchors' must be one of false, true, \"auto\""),
    ({"attention_tile_size": 0}, "memory.attention_tile_size' must be a positive integer, null or \"auto\""),
    ({"attention_tile_size": 1.5}, "memory.attention_tile_size' must be a positive integer, null or \"auto\""),
    ({"attention_backend": "flash"}, "unknown key(s) ['attention_backend'] in 'memory'"),
    ([1], "'memory' must be an object"),
    (0, "'memory' must be an object"),
    ("", "'memory' must be an object"),
])
def test_memory_section_errors_name_file_and_field(section, message):
    with pytest.raises(ConfigError) as err:
        MemoryOptions.pop_from({"memory": section}, "cfg.json")
    assert "cfg.json" in str(err.value) and message in str(err.value)


def test_batch_plan_counts_samples_and_scales_deepspeed_view_by_cp():
    cfg = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2}
    plan = resolve_batch(cfg, dp=2, cp=2)
    assert (plan.global_batch, plan.micro_batch, plan.grad_accum) == (8, 2, 2)
    assert cfg == {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}
    with pytest.raises(ConfigError, match="not divisible"):
        resolve_batch({"train_batch_size": 6, "train_micro_batch_size_per_gpu": 4}, dp=1, cp=1)


def test_scheduler_auto_values(tmp_path):
    cfg = {"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": "auto", "warmup_num_steps": "auto"}}}
    resolve_scheduler(cfg, 100)
    assert cfg["scheduler"]["params"] == {"total_num_steps": 100, "warmup_num_steps": 3}
    bad = tmp_path / "bad.json"
    bad.write_text('{"a": 1,\n "b": }')
    with pytest.raises(ConfigError, match=r"bad.json: invalid JSON at line 2"):
        load_run_config(bad, 1)


@pytest.mark.parametrize("value", [0, False, "", []])
def test_falsy_parallelism_section_is_refused_not_ignored(tmp_path, value):
    import json

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 2, "parallelism": value}))
    with pytest.raises(ConfigError, match=r"ds.json: 'parallelism' must be an object"):
        load_run_config(path, 1)
    path.write_text(json.dumps({"train_batch_size": 2, "parallelism": None}))
    assert load_run_config(path, 1).dims == ParallelDims(world_size=1)


def test_run_config_resolves_layout_batch_dtype_memory_and_scheduler(tmp_path):
    import json

    path = tmp_path / "run.json"
    scheduler = {"type": "WarmupCosineLR", "params": {"total_num_steps": "auto", "warmup_num_steps": "auto"}}
    path.write_text(json.dumps({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
                                "parallelism": {"tp_size": 2}, "memory": {"loss_chunk_size": 64},
                                "scheduler": scheduler}))
    config = load_run_config(path, world_size=8, overrides={"cp_size": 2, "tp_size": None})
    assert config.dims == ParallelDims(world_size=8, tp=2, cp=2, dp=2)
    assert config.plan == BatchPlan(global_batch=8, micro_batch=2, grad_accum=2, dp=2)
    assert config.memory == MemoryOptions(loss_chunk_size=64) and config.bf16
    assert str(config.dtype) == "torch.bfloat16" and config.path == path
    assert config.deepspeed["train_batch_size"] == 16 and "parallelism" not in config.deepspeed
    with pytest.raises(ValueError, match="total steps are not resolved"):
        config.deepspeed_config()
    resolved = config.with_total_steps(200)
    assert resolved.total_steps == 200
    assert resolved.deepspeed_config()["scheduler"]["params"] == {"total_num_steps": 200, "warmup_num_steps": 6}
    assert config.deepspeed["scheduler"]["params"]["total_num_steps"] == "auto"  # the unresolved one is unchanged
    record = resolved.record()
    assert record["parallelism"] == {"tp": 2, "cp": 2, "dp": 2} and record["total_steps"] == 200
    assert record["batch"]["grad_accum"] == 2 and record["dtype"] == "bfloat16"
    assert record["memory"]["loss_chunk_size"] == 64 and json.dumps(record)
    with pytest.raises(ConfigError, match=r"run.json: cannot infer dp.*world_size=3"):
        load_run_config(path, world_size=3)


def test_attention_kernel_is_resolved_for_the_device_and_recorded(tmp_path):
    import json

    from kernels.sdpa_attention import sdpa_available

    path = tmp_path / "run.json"
    path.write_text(json.dumps({"train_batch_size": 1, "kernels": {"attention": "auto"}}))
    config = load_run_config(path, world_size=1)
    assert config.kernels.attention == "auto"
    on_cpu = config.for_device("cpu").with_total_steps(1)
    assert on_cpu.kernels.attention == ("sdpa" if sdpa_available() else "tiled")
    assert on_cpu.record()["kernels"] == {"attention": on_cpu.kernels.attention, "sequence_parallel": "ring",
                                          "compile_small_ops": False}  # "auto": off on the CPU
    assert "attention_backend" not in on_cpu.record()["memory"]
    on_cuda = config.for_device("cuda").kernels  # names only: nothing runs on CUDA here
    assert (on_cuda.attention, on_cuda.compile_small_ops) == ("flex", True)
    path.write_text(json.dumps({"train_batch_size": 1, "kernels": {"attention": "flex"}}))
    with pytest.raises(ConfigError, match=r"run.json: 'kernels.attention': .*'flex' needs a CUDA device"):
        load_run_config(path, world_size=1).for_device("cpu")


# --- unknown keys: the nearest valid name ---------------------------------------------------------------------------

def _load(tmp_path, **changes):
    return load_run_config(write_ds_config(tmp_path / "ds.json", base="zero3_bf16.json", **changes), 1)


@pytest.mark.parametrize("changes,message", [
    ({"zero_optimisation": {"stage": 3}}, "'zero_optimisation': unknown key; did you mean 'zero_optimization'?"),
    ({"optimiser": {}}, "'optimiser': unknown key; did you mean 'optimizer'?"),
    ({"memroy": {}}, "'memroy': unknown key; did you mean 'memory'?"),
    ({"xyzzy": 1}, "'xyzzy': unknown key; neither a DeepSpeed config key nor one of this recipe's sections"),
    ({"zero_optimization": {"stage": 3, "stage3_prefetch_bucketsize": 1}},
     "'zero_optimization.stage3_prefetch_bucketsize': unknown key; did you mean 'stage3_prefetch_bucket_size'?"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memroy": True}}},
     "'zero_optimization.offload_param.pin_memroy': unknown key; did you mean 'pin_memory'?"),
    ({"bf16": {"enabld": True}}, "'bf16.enabld': unknown key; did you mean 'enabled'?"),
    ({"optimizer": {"type": "AdamW", "param": {}}}, "'optimizer.param': unknown key; did you mean 'params'?"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 3}}},
     "'scheduler.params.warmup_num_step': unknown key; did you mean 'warmup_num_steps'?"),
    ({"tensorboard": {"enabled": False, "output_pth": "x"}},
     "bad monitor section (tensorboard.output_pth: Extra inputs are not permitted; did you mean 'output_path'?)"),
    ({"target": {"partition": "zero3", "zero_optimization": {"stage3_max_live_parameter": 1}}},
     "'target.zero_optimization.stage3_max_live_parameter': unknown key; did you mean 'stage3_max_live_parameters'?"),
    ({"memory": {"loss_chunk": 4}}, "unknown key(s) ['loss_chunk'] in 'memory'; did you mean 'loss_chunk_size'?"),
    ({"amp": {"enabled": True}}, "'amp': NVIDIA Apex AMP integration has been removed"),
])
def test_unknown_keys_name_the_nearest_valid_one(tmp_path, changes, message):
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, **changes)
    assert message in str(err.value) and "ds.json" in str(err.value)


def test_comments_and_aliases_are_accepted(tmp_path):
    config = _load(tmp_path, _comment="top", zero_optimization={"stage": 3, "_why": "x",
                                                                "stage3_prefetch_bucket_size": 10,
                                                                "offload_optimizer": {"device": "none", "_c": 1}},
                   memory={"_c": 1}, parallelism={"tp_size": 1, "_c": 1})
    assert config.deepspeed["zero_optimization"] == {"stage": 3, "stage3_prefetch_bucket_size": 10,
                                                     "offload_optimizer": {"device": "none"}}


def test_known_keys_come_from_deepspeed():
    """The top-level set is what DeepSpeed's parser reads: its sections are there, nested keys and removed keys not."""
    keys = deepspeed_top_level_keys()
    assert {"zero_optimization", "bf16", "fp16", "optimizer", "scheduler", "train_batch_size", "gradient_clipping",
            "tensorboard", "data_types", "communication_data_type", "activation_checkpointing"} <= keys
    assert not {"stage", "type", "params", "enabled", "amp", "sparse_attention"} & keys


@pytest.mark.parametrize("key", ["sequence_parallel_size", "data_parallel_size"])
def test_deepspeed_layout_keys_are_refused_naming_our_cp_size(tmp_path, key):
    """DeepSpeed's own layout keys would be ignored (a 2-rank run with ``sequence_parallel_size: 2`` trained as dp 2,
    cp 1): refused by the read run.py, the planner and the dump share, naming the setting that splits the sequence."""
    from recipe.config import read_ds_config

    path = write_ds_config(tmp_path / "ds.json", base="zero3_bf16.json", **{key: 2})
    with pytest.raises(ConfigError) as err:
        read_ds_config(path)
    assert f"ds.json: '{key}':" in str(err.value) and "'parallelism.cp_size'" in str(err.value)
    with pytest.raises(ConfigError, match=key):
        load_run_config(path, world_size=2)


def test_sequence_parallel_size_message_depends_on_parallelism_cp_size(tmp_path):
    """Alone, ``sequence_parallel_size`` is to be replaced by ``parallelism.cp_size``; next to it (as in every shipped
    JSON), it is to be removed, both values named."""
    from recipe.config import read_ds_config

    alone = write_ds_config(tmp_path / "alone.json", base="zero3_bf16.json", sequence_parallel_size=2, parallelism=None)
    with pytest.raises(ConfigError) as err:
        read_ds_config(alone)
    assert "set 'parallelism.cp_size' instead" in str(err.value) and "remove" not in str(err.value)
    both = write_ds_config(tmp_path / "both.json", base="zero3_bf16.json", sequence_parallel_size=2,
                           parallelism={"cp_size": 4})
    with pytest.raises(ConfigError) as err:
        read_ds_config(both)
    assert ("both.json: 'sequence_parallel_size': 2 next to 'parallelism.cp_size': 4; remove 'sequence_parallel_size'"
            in str(err.value)) and "already sets the context-parallel size" in str(err.value)
    assert "instead" not in str(err.value) and "set 'parallelism.cp_size': 2" in str(err.value)


def test_run_py_refuses_sequence_parallel_size_before_any_work(tmp_path, monkeypatch, capsys):
    """run.py answers before the process group (or anything else) is started: init_distributed is never called."""
    import recipe.lifecycle.distributed as distributed
    from run import main

    def no_world(*args, **kwargs):
        raise AssertionError("init_distributed was called")

    monkeypatch.setattr(distributed, "init_distributed", no_world)
    path = write_ds_config(tmp_path / "ds.json", base="zero3_bf16.json", sequence_parallel_size=2)
    code = main(["--ds_config", str(path), "--target", str(tmp_path / "t"), "--hidden-states", str(tmp_path / "s"),
                 "--output", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "'sequence_parallel_size'" in err and "parallelism.cp_size" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()
