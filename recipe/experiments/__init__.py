"""Experiments: whole training runs per arm, compared by the acceptance length τ they reach (``data``: data recipes
at equal compute; ``long_context``: short, long, warm-started and position-robust drafts by context length;
``demo_gpu``: the demo at GPU scale). ``python -m recipe.experiments {data,long-context,demo-gpu}``."""
