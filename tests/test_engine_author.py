"""An engine that owns its KV pages (vLLM's page layout, two pages a block) and uses kvtier
for prefix caching through KVAdapter.load_into / save_from, as docs/adapter.md describes:
greedy outputs with a loaded prefix equal those computed from scratch, the cached-token
counts are the blocks saved, a restarted store serves them from disk, and the mistakes an
engine author makes are clear kvtier errors."""
from __future__ import annotations

import math

import pytest
import torch

import kvtier
from kvtier.adapter import KVAdapter
from kvtier.transfer import PagedKV

LAYERS, KV_HEADS, HEAD_DIM, HEADS, HIDDEN, VOCAB = 2, 2, 8, 4, 32, 64
PAGE_TOKENS, BLOCK_TOKENS, NUM_PAGES = 4, 8, 64
PPB = BLOCK_TOKENS // PAGE_TOKENS
LAYOUT = kvtier.KVLayout.mha(num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                             block_tokens=BLOCK_TOKENS, dtype=torch.float32)
NS = kvtier.Namespace(model="engine-author-toy", revision="seed0")


class Toy:
    """A few-layer attention model over its own paged KV cache ([2, pages, page_tokens, heads, dim] a layer)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        r = lambda *s: torch.randn(*s, generator=g) * 0.3     # noqa: E731
        self.emb, self.head = r(VOCAB, HIDDEN), r(HIDDEN, VOCAB)
        self.w = [(r(HIDDEN, HEADS * HEAD_DIM), r(HIDDEN, KV_HEADS * HEAD_DIM), r(HIDDEN, KV_HEADS * HEAD_DIM),
                   r(HEADS * HEAD_DIM, HIDDEN)) for _ in range(LAYERS)]
        self.kv = [torch.zeros(2, NUM_PAGES, PAGE_TOKENS, KV_HEADS, HEAD_DIM) for _ in range(LAYERS)]

    def forward(self, tokens: list[int], start: int, pages: list[int], before_layer=None) -> torch.Tensor:
        t = len(tokens)
        pos = torch.arange(start, start + t)
        pg = torch.tensor(pages)
        x = self.emb[torch.tensor(tokens)]
        for i, (wq, wk, wv, wo) in enumerate(self.w):
            if before_layer is not None:
                before_layer(i)
            q, k, v = (x @ wq).view(t, HEADS, HEAD_DIM), (x @ wk).view(t, KV_HEADS, HEAD_DIM), (x @ wv).view(t, KV_HEADS, HEAD_DIM)
            k = k + torch.sin(pos.float())[:, None, None]        # position-dependent KV
            self.kv[i][0, pg[pos // PAGE_TOKENS], pos % PAGE_TOKENS] = k
            self.kv[i][1, pg[pos // PAGE_TOKENS], pos % PAGE_TOKENS] = v
            n = start + t
            kk = self.kv[i][0, pg].reshape(-1, KV_HEADS, HEAD_DIM)[:n].repeat_interleave(HEADS // KV_HEADS, 1)
            vv = self.kv[i][1, pg].reshape(-1, KV_HEADS, HEAD_DIM)[:n].repeat_interleave(HEADS // KV_HEADS, 1)
            att = torch.einsum("thd,shd->hts", q, kk) / math.sqrt(HEAD_DIM)
            att = att.masked_fill(torch.arange(n)[None, None, :] > pos[None, :, None], float("-inf")).softmax(-1)
            x = x + torch.einsum("hts,shd->thd", att, vv).reshape(t, -1) @ wo
        return x @ self.head

    def generate(self, prompt: list[int], new: int, adapter: KVAdapter | None = None,
                 paged: PagedKV | None = None, session: str | None = None) -> tuple[list[int], int]:
        pages = list(range(math.ceil((len(prompt) + new) / PAGE_TOKENS)))
        table = lambda b0, b1: torch.tensor(pages[b0 * PPB:b1 * PPB]).view(b1 - b0, PPB)   # noqa: E731
        cached, load = 0, None
        if adapter is not None:
            match = adapter.lookup(prompt[:-1])            # the last token is computed: its logits
            if match.blocks:
                load = adapter.load_into(match.keys[:match.blocks], paged, table(0, match.blocks))
                cached = load.loaded * BLOCK_TOKENS
        logits = self.forward(prompt[cached:], cached, pages, load.wait_for_layer if load else None)
        if load is not None:
            assert load.wait() * BLOCK_TOKENS == cached
        seq, out = list(prompt), [int(logits[-1].argmax())]
        for _ in range(new - 1):
            seq.append(out[-1])
            out.append(int(self.forward([out[-1]], len(seq) - 1, pages)[-1].argmax()))
        if adapter is not None:                             # every full block whose KV is written
            keys = adapter.keys(seq)
            if len(keys) > cached // BLOCK_TOKENS:
                s = adapter.save_from(keys[cached // BLOCK_TOKENS:], paged, table(cached // BLOCK_TOKENS, len(keys)))
                s.wait_for_pages()
                s.wait()
            if session is not None:
                adapter.pin(session, keys, ttl=600)
        return out, cached


def test_sessions_cached_prefix_equals_scratch_and_survives_restart(tmp_path):
    g = torch.Generator().manual_seed(1)
    system = torch.randint(0, VOCAB, (20,), generator=g).tolist()          # 2 full blocks
    turns = [[torch.randint(0, VOCAB, (5 + 3 * s + t,), generator=g).tolist() for t in range(2)] for s in range(2)]
    config = kvtier.StoreConfig(host_capacity=64 * LAYOUT.block_bytes, disk_path=str(tmp_path / "kv"),
                                disk_capacity="1MiB")
    engine, scratch = Toy(), Toy()

    def run(expected: list[list[int]] | None) -> list[list[int]]:
        got = []
        with config.build(LAYOUT, NS) as store:
            adapter = KVAdapter(store)
            paged = PagedKV(engine.kv, LAYOUT, "vllm")
            hist = [list(system) for _ in turns]
            for t in range(2):
                for s in range(len(turns)):
                    prompt = hist[s] + turns[s][t]
                    out, cached = engine.generate(prompt, 6, adapter, paged, session=f"agent-{s}")
                    assert out == scratch.generate(prompt, 6)[0]
                    got.append([len(prompt), cached])
                    hist[s] = prompt + out
            adapter.close()
        return got

    first = run(None)
    # agent-0 starts cold; agent-1 shares the system prompt's 2 blocks; on turn 2 each agent
    # finds its whole first turn (prompt and answer, less the last answer token) in full blocks
    for i, (n, cached) in enumerate(first):
        if i == 0:
            assert cached == 0
        elif i == 1:
            assert cached == 16
        else:
            prev = first[i - 2][0] + 6 - 1                  # tokens whose KV turn 1 wrote
            assert cached == min(prev // BLOCK_TOKENS, (n - 1) // BLOCK_TOKENS) * BLOCK_TOKENS
    again = run(None)                                       # a restarted engine: the disk tier's blocks
    assert again[0][1] == (first[0][0] - 1) // BLOCK_TOKENS * BLOCK_TOKENS
    assert all(b[1] >= a[1] for a, b in zip(first, again))


@pytest.fixture
def engine_store():
    store = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=32)], NS)
    adapter = KVAdapter(store)
    kv = [torch.randn(2, NUM_PAGES, PAGE_TOKENS, KV_HEADS, HEAD_DIM) for _ in range(LAYERS)]
    yield adapter, PagedKV(kv, LAYOUT, "vllm"), kv
    adapter.close()
    store.close()


def test_a_closed_adapter_refuses_loads_and_saves(engine_store):
    adapter, paged, _ = engine_store
    keys = adapter.keys(list(range(16)))
    table = torch.arange(4).view(2, PPB)
    adapter.save_from(keys, paged, table).wait()
    adapter.close()
    # before: a load or save restarted a loader thread that nothing would stop again
    with pytest.raises(kvtier.ClosedError, match="KVAdapter is closed"):
        adapter.load_into(keys, paged, table)
    with pytest.raises(kvtier.ClosedError, match="KVAdapter is closed"):
        adapter.save_from(keys, paged, table)
    assert adapter.lookup(list(range(16))).blocks == 2      # the store itself stays usable


def test_a_closed_adapter_refuses_device_tier_loads():
    store = kvtier.Store(LAYOUT, [kvtier.DeviceTier(blocks=4, device="cpu"), kvtier.HostTier(blocks=8)], NS)
    adapter = KVAdapter(store)
    try:
        adapter.close()
        with pytest.raises(kvtier.ClosedError, match="KVAdapter is closed"):
            adapter.load(adapter.lookup(list(range(16))))
    finally:
        store.close()


def test_pages_on_a_device_kvtier_cannot_move_are_refused_clearly(engine_store):
    adapter, _, kv = engine_store
    meta = PagedKV([t.to("meta") for t in kv], LAYOUT, "vllm")
    keys = adapter.keys(list(range(16)))
    table = torch.arange(4).view(2, PPB)
    # before: "checked=True takes what this PagedKV's table() returned ...", about kvtier's internals
    for call in (adapter.load_into, adapter.save_from):
        with pytest.raises(kvtier.LayoutError, match="on meta.*CPU or a CUDA GPU"):
            call(keys, meta, table)


def test_engine_author_mistakes_are_kvtier_errors(engine_store, tmp_path):
    adapter, paged, kv = engine_store
    keys = adapter.keys(list(range(32)))                      # 4 blocks
    table = torch.arange(8).view(4, PPB)
    with pytest.raises(kvtier.LayoutError, match="dtype"):
        PagedKV([t.half() for t in kv], LAYOUT, "vllm")
    with pytest.raises(kvtier.LayoutError, match="multiple of the engine's page_tokens"):
        PagedKV([torch.zeros(2, NUM_PAGES, 3, KV_HEADS, HEAD_DIM) for _ in range(LAYERS)], LAYOUT, "vllm")
    with pytest.raises(kvtier.LayoutError, match="one row per block"):
        adapter.load_into(keys, paged, table[:3])
    with pytest.raises(kvtier.LayoutError, match="more than once"):
        adapter.load_into(keys[:2], paged, torch.tensor([[0, 1], [1, 2]]))
    with pytest.raises(kvtier.LayoutError, match="engine has pages"):
        adapter.load_into(keys[:1], paged, torch.tensor([[0, NUM_PAGES]]))
    with pytest.raises(kvtier.LayoutError, match="16-byte block key"):
        adapter.load_into(list(range(32)), paged, table)        # tokens, not keys
    with kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=8)], kvtier.Namespace(model="other")) as other:
        for call in (adapter.load_into, adapter.save_from):
            with pytest.raises(kvtier.ForeignKeysError):
                call(other.keys(list(range(32))), paged, table)
    with pytest.raises(kvtier.LayoutError, match="PagedKV"):
        adapter.load_into(keys, kv, table)                      # the raw tensors
    first = adapter.save_from(keys, paged, table).wait()
    twice = adapter.save_from(keys, paged, table).wait()        # the same blocks again: nothing copied
    assert (first.blocks, twice.blocks, twice.present) == (4, 0, 4)
    with pytest.raises(kvtier.CapacityError, match="fewer blocks"):
        big = adapter.keys(list(range(1000, 1000 + 33 * BLOCK_TOKENS)))
        adapter.save_from(big, PagedKV([torch.zeros(2, 66, PAGE_TOKENS, KV_HEADS, HEAD_DIM) for _ in range(LAYERS)],
                                       LAYOUT, "vllm"), torch.arange(66).view(33, PPB))
    adapter.store.close()
    for call in (adapter.load_into, adapter.save_from):
        with pytest.raises(kvtier.ClosedError):
            call(keys, paged, table)


def test_the_engine_owned_pages_example_in_adapter_md_runs_as_written(tmp_path):
    import re
    import subprocess
    import sys

    from tests.conftest import REPO, child_env

    text = (REPO / "docs" / "adapter.md").read_text()
    section = text.split("## An engine that owns its pages", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                       env=child_env(TMPDIR=str(tmp_path)), timeout=300)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert r.stdout.splitlines() == ["first run: 0 of 100 tokens loaded, from []",
                                     "after a restart: 96 of 100 tokens loaded, from " + str(["disk"] * 6)], r.stdout
