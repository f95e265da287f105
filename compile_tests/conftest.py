"""Every compile test starts from a clean Dynamo cache: compiled code is cached
per code object (e.g. `KDADecodeStep.decode_step`), so compile counts and
recompile limits would otherwise leak from one test into the next."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
