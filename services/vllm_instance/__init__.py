"""A real vLLM instance as a child process: the interpreter of its own venv, its command line and
environment with the BEAR scheduler plugin, and the tiny random model that CPU runs serve."""
