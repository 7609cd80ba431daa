"""What an instance tells the bus — its registry record and heartbeat, its snapshots and batch
records — with one publication policy shared by the vLLM snapshotter and the simulated engine."""
