"""Hybrid KV managers on real memory (CPU tensors): laid out as each manager lays its
pool, and the byte split measured on the device equal to the simulated one at every step."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from fragsim.catalog import get_gpu, get_model  # noqa: E402
from fragsim.hybrid import create_manager  # noqa: E402
from fragsim.simulate import RunSpec  # noqa: E402
from gpu_backend.hybrid_layout import layout_of, miniature  # noqa: E402
from gpu_backend.hybrid_pool import HybridPool  # noqa: E402
from gpu_backend.pool import kv_values  # noqa: E402
from gpu_backend.validate import HybridShape, run_hybrid_validation  # noqa: E402

SHAPE = HybridShape(dtype="float32")


def _validate(model: str, allocator: str, pool_bytes: int, *, requests: int = 40, corrupt=None,
              attention_every: int = 3, **spec) -> object:
    run = RunSpec(trace="azure-conv", model=model, gpu="h100-80gb", num_requests=requests,
                  max_seq_len=4096, rate=20.0, **spec)
    return run_hybrid_validation(run, allocator, shape=SHAPE, scale=0.1, attention_every=attention_every,
                                 pool_bytes=pool_bytes, corrupt=corrupt)


# gpt-oss: sliding 128 + full; Nemotron-H: Mamba-2 + full; Gemma 3: five sliding groups
# and a full one; Llama 4: chunked local + full (vLLM keeps its hybrid manager for
# chunks only when asked); Qwen3-Next: Gated DeltaNet + full; DeepSeek V3: MLA latents.
CASES = [
    ("gpt-oss-20b", "vllm-hybrid", 60_000, {}),
    ("gpt-oss-20b", "jenga", 60_000, {}),
    ("gpt-oss-20b", "static-partition", 60_000, {}),
    ("gpt-oss-20b", "paged-uniform", 60_000, {}),
    ("nemotron-h-8b", "vllm-hybrid", 120_000, {}),
    ("nemotron-h-8b", "jenga", 120_000, {}),
    ("nemotron-h-8b", "static-partition", 400_000, {}),
    ("nemotron-h-8b", "paged-uniform", 2_950_000, {}),
    ("gemma-3-27b", "vllm-hybrid", 400_000, {}),
    ("llama-4-scout", "vllm-hybrid", 60_000, {"hybrid_chunked": True}),
    ("llama-4-scout", "jenga", 60_000, {}),
    ("qwen3-next-80b-a3b", "jenga", 200_000, {}),
    ("deepseek-v3", "vllm-hybrid", 60_000, {}),
]


@pytest.mark.parametrize(("model", "allocator", "pool_bytes", "spec"), CASES,
                         ids=[f"{m}-{a}" for m, a, _, _ in CASES])
def test_device_split_equals_simulated_at_every_step(model, allocator, pool_bytes, spec) -> None:
    report = _validate(model, allocator, pool_bytes, requests=30, attention_every=6, **spec)
    assert report.error is None, report.error
    assert report.ok
    assert report.steps_checked > 30
    assert report.attention_checks > 0 and report.content_checks > 0
    if "mamba" in " ".join(report.rows) or "linear" in " ".join(report.rows):
        assert report.state_checks > 0
    # Every row has a line per category it used, and each was equal at every step.
    quantities = [row["quantity"] for row in report.table]
    assert any(q.endswith("token_states (bytes)") for q in quantities)


def test_window_frees_reused_blocks_and_reads_stay_correct() -> None:
    """A small pool under pressure: sliding-window blocks fall out of the window, go back
    to the free queue, are taken by other requests, and every read inside every
    window (attention and stored K/V) stays correct."""
    report = _validate("gpt-oss-20b", "vllm-hybrid", 60_000, attention_every=4)
    assert report.ok, report.error
    assert report.window_reuses > 20
    assert report.preemptions > 0
    assert report.attention_checks > 100 and report.content_checks > 100


def _reused_block(backend) -> tuple[int, int, int] | None:
    """(row, block, holder) of a block a window freed that another request now holds
    with a stored position in it."""
    pool = backend.pool
    for r, b in sorted(backend._window_freed):
        holder = int(pool.owner[r][b].item())
        if holder >= 0 and bool(pool.written[r][b].any()):
            return r, b, holder
    return None


def test_stale_write_into_a_reused_block_is_caught_naming_request_and_position() -> None:
    """The old holder of a block its window freed writes into it once more (the bug a
    missed free causes): the new holder's read names it and the position."""
    hit: list[tuple[int, int, int, int]] = []

    def corrupt(backend, engine) -> None:
        if hit:
            return
        found = _reused_block(backend)
        if found is None:
            return
        r, b, holder = found
        pool = backend.pool
        row = pool.layout.rows[r]
        offset = int(torch.nonzero(pool.written[r][b])[0].item())
        position = int(pool.index[r][b].item()) * row.block_tokens + offset
        k, _ = pool.kv(r, 0)
        stale = torch.tensor([holder + 1])
        k[b, offset] = kv_values(stale, torch.tensor([position]), row.layer_ids[0], row.kv_heads,
                                 row.head_dim, pool.dtype, 0)[0]
        hit.append((r, b, holder, position))

    report = _validate("gpt-oss-20b", "vllm-hybrid", 60_000, corrupt=corrupt, attention_every=1)
    assert hit, "no block freed by a window was reused"
    assert not report.ok
    _, block, holder, position = hit[0]
    assert f"request {holder} position {position}" in report.error
    assert f"block {block}" in report.error


def test_corrupted_state_is_caught_on_its_next_read() -> None:
    done: list[int] = []

    def corrupt(backend, engine) -> None:
        pool = backend.pool
        if done:
            return
        for r, row in enumerate(pool.layout.rows):
            held = torch.nonzero(pool.state_len[r] >= 0).flatten()
            if row.is_state and len(held):
                block = int(held[0].item())
                pool.state(r, 0, block)[3] ^= 0xFF
                done.append(int(pool.owner[r][block].item()))
                return

    report = _validate("nemotron-h-8b", "jenga", 120_000, corrupt=corrupt, attention_every=1)
    assert done and not report.ok
    assert f"request {done[0]}'s state" in report.error


def test_a_wrong_simulated_split_is_caught(monkeypatch) -> None:
    """The device measures; it does not copy the simulator's numbers."""
    from fragsim.hybrid.groups import RESERVATION, TOKEN
    from fragsim.hybrid.manager import HybridManager

    real = HybridManager.split

    def off_by_one_token(self, seqs, computed, receiving=None):
        out = real(self, seqs, computed, receiving)
        if len(seqs):
            out[0, TOKEN] += self.rows[0].token_bytes
            out[0, RESERVATION] -= self.rows[0].token_bytes
        return out

    monkeypatch.setattr(HybridManager, "split", off_by_one_token)
    report = _validate("gpt-oss-20b", "jenga", 60_000)
    assert not report.ok
    assert "sliding 13 token_states: simulated" in report.error


@pytest.mark.parametrize("allocator", ["vllm-hybrid", "jenga", "static-partition", "paged-uniform"])
def test_layouts_keep_distinct_units_apart(allocator: str) -> None:
    """Every (row, block id, layer) page lies inside the pool, and two pages overlap only
    where the manager shares the memory by design: vLLM's one block id in several
    groups, Jenga's one large page carved for one kind or another."""
    mini = miniature(get_model("nemotron-h-8b"), scale=0.1, dtype_bytes=4)
    m = create_manager(allocator, mini, get_gpu("h100-80gb"), pool_bytes=3_000_000, max_seq_len=512)
    lay = layout_of(m, mini)
    pool = HybridPool(lay, dtype=torch.float32)   # checks every page ends inside the pool
    spans = []
    for r, row in enumerate(lay.rows):
        size = row.layer_bytes
        for j, base in enumerate(row.layer_base):
            for b in range(row.num_ids):
                spans.append((base + b * row.block_stride, size, r, b, j))
    spans.sort()
    for (s0, n0, r0, b0, _), (s1, _, r1, b1, _) in zip(spans, spans[1:], strict=False):
        if s0 + n0 > s1:
            assert r0 != r1, (allocator, r0, b0, b1)
            if allocator == "jenga":
                assert s0 // m.large_page_bytes == s1 // m.large_page_bytes
            else:
                assert allocator == "vllm-hybrid" and b0 == b1, (allocator, r0, b0, r1, b1)
    assert pool.measure()[:, -1].sum() + lay.fixed_padding == lay.capacity


def test_cli_validates_hybrid_managers(tmp_path, capsys) -> None:
    from fragsim.cli import main

    rc = main(["validate", "--device", "cpu", "--model", "gpt-oss-20b", "--allocator", "vllm-hybrid,jenga",
               "--trace", "azure-conv", "--rate", "20", "--num-requests", "20", "--scale", "0.1",
               "--pool-bytes", "60000", "--dtype", "float32", "--json", "--out", str(tmp_path)])
    assert rc == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["allocator"] for r in lines] == ["vllm-hybrid", "jenga"]
    assert all(r["ok"] and r["steps_checked"] > 0 for r in lines)
    assert list(tmp_path.glob("validate-*.json"))


def test_cli_refuses_mixed_dense_and_hybrid(tmp_path, capsys) -> None:
    from fragsim.cli import main

    rc = main(["validate", "--device", "cpu", "--allocator", "vllm,jenga", "--out", str(tmp_path)])
    assert rc == 2
    assert "apart from the dense allocators" in capsys.readouterr().err


def test_prefix_caching_is_refused_on_the_device() -> None:
    with pytest.raises(ValueError, match="prefix caching"):
        _validate("gpt-oss-20b", "vllm-hybrid", 60_000, prefix_caching=True)


@pytest.mark.parametrize("model", ["qwen3-next-80b-a3b", "deepseek-v3", "nemotron-h-56b"])
def test_validate_sizes_the_pool_for_the_miniature_not_the_full_model(model, tmp_path, capsys) -> None:
    # none of these fits the default a100-40gb; with no --allocator and no --pool-bytes the
    # hybrid managers run on a miniature whose pool is sized for the miniature
    from fragsim.cli import main

    assert main(["validate", "--device", "cpu", "--model", model, "--num-requests", "8",
                 "--out", str(tmp_path), "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["allocator"] for r in rows] == ["vllm-hybrid", "jenga", "static-partition", "paged-uniform"]
    assert all(r["ok"] and r["pool_bytes"] > 0 for r in rows)
