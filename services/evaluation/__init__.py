"""``bear eval``: the paper's routing experiments in a virtual-time simulation of a vLLM pool."""
