# The compiled BEA core (libbea/, pybind11): no generated stubs, so to the type checker every name
# in it is Any. Its Python-facing contract is tested in tests/libbea.
from typing import Any

def __getattr__(name: str) -> Any: ...
