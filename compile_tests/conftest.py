"""Every compile test starts from a clean Dynamo cache: compiled code is cached
per code object (e.g. `KDADecodeStep.decode_step`), so compile counts and
recompile limits would otherwise leak from one test into the next. A test that
drew caches of a GiB or more ends its turn with them (compile_helpers)."""

import pytest
import torch

from compile_helpers import end_large_caches_turn


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    end_large_caches_turn()
