"""The benchmark's setups (kda_ops.bench) on CPU tensors: every op's calls run,
and the bytes each op is divided by are the bytes of the tensors it must read
and write once (docs/performance.md, Method), counted here from the tensors."""

import pytest
import torch

from kda_ops import bench
from kda_ops.models import KDADecodeStep

SHAPE = bench.Shape(batch=2, spec_len=3, layers=2, heads=2, key_dim=16, value_dim=8)


def nbytes(*specs):
    """Bytes of tensors given as (shape, dtype)."""
    return sum(torch.empty(shape, dtype=dtype, device="meta").nbytes for shape, dtype in specs)


def expected_bytes(shape, op):
    B, n, L, H, K, V = (shape.batch, shape.tokens, shape.layers, shape.heads, shape.key_dim,
                        shape.value_dim)
    D, W, T, act, st = (shape.conv_dim, shape.conv_width, shape.spec_len, shape.act_dtype,
                        shape.state_dtype)
    f32 = torch.float32
    verify = nbytes(((B, H, V, K), st),                                    # state blocks read
                    ((n, H, K), act), ((n, H, K), act), ((n, H, K), act),  # q, k, g
                    ((n, H, V), act), ((n, H), act),                       # v, beta
                    ((n, H, V), act),                                      # out
                    ((B, H, T, V), f32), ((B, H, T, 2 * K), act))          # records
    conv = nbytes(((n, D), act), ((n, D), act),                            # x, out
                  ((B, D, W - 1), act), ((B, D, W - 1 + T - 1), act))      # history, window
    commit = L * nbytes(((B, H, V, K), st), ((B, H, V, K), st),            # state read, written
                        ((B, H, T, V), f32), ((B, H, T, 2 * K), act),      # records of T tokens
                        ((B, D, W - 1), act), ((B, D, W - 1), act))        # history read, written
    return {"verify": verify, "conv_update": conv, "commit": commit,
            "verify_commit": L * verify + commit, "step": L * (conv + verify) + commit}[op]


@pytest.mark.parametrize("op", sorted(bench.SETUPS))
def test_setup_runs_and_counts_the_bytes_it_moves(op):
    calls, moved = bench.SETUPS[op](SHAPE, "cpu")
    assert len(calls) > 1, "the calls must rotate over index sets"
    calls[0]()
    calls[-1]()
    assert moved == expected_bytes(SHAPE, op)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_model_step_bytes(state_dtype):
    shape = bench.Shape(batch=3, spec_len=2, layers=3, heads=2, key_dim=8, value_dim=16,
                        conv_width=3, act_dtype=torch.float16, state_dtype=state_dtype)
    model = KDADecodeStep.for_benchmark(shape, "cpu")
    assert model.step_bytes(shape.batch) == expected_bytes(shape, "step")
    fewer = expected_bytes(shape, "step") - shape.layers * nbytes(
        ((shape.batch, shape.heads, 1, shape.value_dim), torch.float32),
        ((shape.batch, shape.heads, 1, 2 * shape.key_dim), shape.act_dtype))
    assert model.step_bytes(shape.batch, accepted=1) == fewer


@pytest.mark.parametrize("argv, argument", [
    (["--ops", "verify,unknown"], "--ops"),
    (["--batches", "8,0"], "--batches"),
    (["--spec-lens", "4,x"], "--spec-lens"),
    (["--layers", "0"], "--layers"),
])
def test_command_line_rejects_bad_values_naming_the_argument(argv, argument, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(argv)
    assert exit_info.value.code == 2
    assert f"argument {argument}" in capsys.readouterr().err
