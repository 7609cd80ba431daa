"""The simulated vLLM instance: vLLM V1 scheduling (libbea's Scheduler) timed by a roofline
ground-truth model, behind an OpenAI-compatible streaming API, publishing the same snapshots and
batch records as a real instance (docs/sim-engine.md)."""
