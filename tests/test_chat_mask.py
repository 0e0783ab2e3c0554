"""Golden loss masks: the exact decoded text of every supervised run, for real template styles."""

import copy

import pytest
from transformers import AutoTokenizer

from recipe.data.chat_mask import tokenize_conversation
from recipe.data.conversations import BadRow

# the goldens are SmolLM2's real tokenizer (the `assets` fixture prepares the real assets)
pytestmark = pytest.mark.slow

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hi there!"},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
]

# Llama-3 style: header tokens, content trimmed, <|eot_id|> closes every turn.
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# Qwen2.5 style ChatML: a default system turn is injected when the conversation has none.
QWEN_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}"
    "{{ '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}"
    "{% endif %}{% for message in messages %}{% if message['role'] != 'system' or not loop.first %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Renders the last message differently (an end-of-text token, no newline): prefixes are not prefixes of the whole.
LAST_DIFFERS_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' }}"
    "{% if loop.last %}{{ '<|endoftext|>' }}{% else %}{{ '\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Qwen3 style reasoning template (written for this test after Qwen3's behaviour): an assistant content of the form
# "<think>R</think>A" renders as "<think>\nR\n</think>\n\nA" after the last user turn and as "A" alone before it.
QWEN3_TEMPLATE = (
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_query = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{%- set content = message.content %}{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_query %}"
    "{{- '<|im_start|>assistant\n<think>\n' + reasoning + '\n</think>\n\n' + content + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>assistant\n' + content + '<|im_end|>\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def smollm2_tokenizer(assets):
    return AutoTokenizer.from_pretrained(assets.target)


@pytest.fixture
def tokenizer(smollm2_tokenizer):
    """SmolLM2's real tokenizer (ChatML template), a private copy per test because tests change its template."""
    return copy.deepcopy(smollm2_tokenizer)


def supervised_runs(tokenizer, messages):
    tokens = tokenize_conversation(messages, tokenizer)
    assert tokens.input_ids == tokenizer.apply_chat_template(messages, tokenize=True)["input_ids"]
    assert set(tokens.loss_mask) <= {0, 1} and len(tokens.loss_mask) == len(tokens.input_ids)
    runs, current = [], []
    for token, keep in zip(tokens.input_ids + [0], tokens.loss_mask + [0]):
        if keep:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    return runs


def test_chatml_smollm2_golden(tokenizer):
    assert supervised_runs(tokenizer, CONVERSATION) == ["Hi there!<|im_end|>", "4<|im_end|>"]
    # SmolLM2's template injects its default system prompt when there is none: same supervised text.
    assert supervised_runs(tokenizer, CONVERSATION[1:]) == ["Hi there!<|im_end|>", "4<|im_end|>"]
    tokens = tokenize_conversation(CONVERSATION, tokenizer)
    first = tokens.loss_mask.index(1)
    # Exactly the header precedes the first supervised token; exactly "\n" follows the last one.
    assert tokenizer.decode(tokens.input_ids[:first]).endswith("Hello<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.decode(tokens.input_ids[-1:]) == "\n"
    assert tokens.loss_mask[-2:] == [1, 0]


def test_llama3_style_golden(tokenizer):
    tokenizer.add_special_tokens(
        {"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]})
    tokenizer.chat_template = LLAMA3_TEMPLATE
    messages = [dict(m) for m in CONVERSATION]
    messages[2]["content"] = "  Hi there!\n"  # the template trims it
    assert supervised_runs(tokenizer, messages) == ["Hi there!<|eot_id|>", "4<|eot_id|>"]


def test_default_system_prompt_template_golden(tokenizer):
    tokenizer.chat_template = QWEN_TEMPLATE
    assert supervised_runs(tokenizer, CONVERSATION) == ["Hi there!<|im_end|>", "4<|im_end|>"]
    assert supervised_runs(tokenizer, CONVERSATION[1:]) == ["Hi there!<|im_end|>", "4<|im_end|>"]
    # An assistant-first conversation: messages[:0] cannot be rendered (messages[0] undefined) -> fallback path.
    opening = [{"role": "assistant", "content": "Welcome."}] + CONVERSATION[1:]
    assert supervised_runs(tokenizer, opening) == ["Welcome.<|im_end|>", "Hi there!<|im_end|>", "4<|im_end|>"]


def test_template_rendering_last_message_differently_golden(tokenizer):
    tokenizer.chat_template = LAST_DIFFERS_TEMPLATE
    assert supervised_runs(tokenizer, CONVERSATION) == ["Hi there!<|im_end|>", "4<|im_end|><|endoftext|>"]
    assert supervised_runs(tokenizer, CONVERSATION[:3] + [CONVERSATION[3]]) == ["Hi there!<|im_end|>"]


def test_content_transformed_by_template_uses_prefixes_not_search(tokenizer):
    tokenizer.chat_template = tokenizer.chat_template.replace("message['content']", "message['content'] | upper")
    assert supervised_runs(tokenizer, CONVERSATION) == ["HI THERE!<|im_end|>", "4<|im_end|>"]


def test_template_errors_are_bad_rows(tokenizer):
    tokenizer.chat_template = "{{ raise_exception('Conversation roles must alternate user/assistant') }}"
    with pytest.raises(BadRow) as err:
        tokenize_conversation(CONVERSATION, tokenizer)
    assert err.value.reason == "template_error" and "alternate" in err.value.detail
    # Unlocatable turn: upper-cased content and a last-message-dependent rendering defeat both methods.
    tokenizer.chat_template = LAST_DIFFERS_TEMPLATE.replace("message['content']", "message['content'] | upper")
    with pytest.raises(BadRow) as err:
        tokenize_conversation(CONVERSATION, tokenizer)
    assert err.value.reason == "template_error"


def test_missing_chat_template_is_an_error(tokenizer):
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat_template"):
        tokenize_conversation(CONVERSATION, tokenizer)


def test_qwen3_reasoning_template_golden(tokenizer):
    """Earlier turns are supervised as the template renders them (answer only, reasoning dropped), the turn after
    the last user turn with its reasoning block, as the model writes it at inference."""
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = QWEN3_TEMPLATE
    messages = [{"role": "user", "content": "Hello"},
                {"role": "assistant", "content": "<think>\nGreet back.\n</think>\n\nHi there!"},
                {"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": "<think>\nAdd.\n</think>\n\n4"}]
    assert supervised_runs(tokenizer, messages) == [
        "Hi there!<|im_end|>", "<think>\nAdd.\n</think>\n\n4<|im_end|>"]
    # A last turn without reasoning renders an empty think block, which is supervised too.
    plain = messages[:3] + [{"role": "assistant", "content": "4"}]
    assert supervised_runs(tokenizer, plain) == ["Hi there!<|im_end|>", "<think>\n\n</think>\n\n4<|im_end|>"]
    # Two assistant turns after the last user turn both keep their reasoning.
    tail = messages + [{"role": "assistant", "content": "<think>\nMore.\n</think>\n\nReally."}]
    assert supervised_runs(tokenizer, tail)[1:] == ["<think>\nAdd.\n</think>\n\n4<|im_end|>",
                                                    "<think>\nMore.\n</think>\n\nReally.<|im_end|>"]


def test_openai_text_parts_golden(tokenizer):
    from recipe.data.conversations import normalise_record

    record = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"}]},
                           {"role": "assistant", "content": [{"type": "text", "text": "Hi"},
                                                             {"type": "text", "text": "there!"}]}]}
    messages = normalise_record(record)
    assert messages == [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi\nthere!"}]
    assert supervised_runs(tokenizer, messages) == ["Hi\nthere!<|im_end|>"]
