"""Pushing blocks to another node (kvtier/net/push.py, the prefill side of `--handoff push`),
in one process on loopback: byte-exact arrival, nothing sent twice, and a receiver that is
gone or cannot take the blocks ends the push early without raising or hanging."""
from __future__ import annotations

import threading
import time

import pytest
import torch

import kvtier
from kvtier.net import Node, PeerClient, PeerError
from kvtier.net.push import Pusher
from tests.conftest import payload

LAYOUT = kvtier.KVLayout.mha(num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=8, dtype=torch.float16)  # 8 KiB
NS = kvtier.Namespace("push-test", "r1")
SECRET = b"cluster-secret-0123456789abcdef"


def store(blocks: int = 64) -> kvtier.Store:
    return kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=blocks)], NS)


def test_push_lands_byte_exact_and_is_not_sent_twice():
    sender, receiver = store(), store()
    keys = sender.keys(list(range(8 * 10)))                   # 10 blocks
    sender.put(keys, payload(keys, LAYOUT.block_bytes))
    pusher = Pusher(SECRET, chunk=4)                           # 3 PUTs: 4 + 4 + 2
    with Node(receiver, "127.0.0.1:0", SECRET) as node:
        out = pusher.push(sender, keys, node.address)
        assert (out.blocks, out.sent, out.bytes, out.error) == (10, 10, 10 * LAYOUT.block_bytes, "")
        assert receiver.lookup(keys).blocks == 10
        got = torch.zeros(10, LAYOUT.block_bytes, dtype=torch.uint8)
        assert receiver.get(keys, got).loaded == 10 and torch.equal(got, payload(keys, LAYOUT.block_bytes))
        longer = sender.keys(list(range(8 * 12)))
        sender.put(longer, payload(longer, LAYOUT.block_bytes))
        again = pusher.push(sender, longer, node.address)     # the receiver holds 10: 2 are sent
        assert (again.blocks, again.sent) == (12, 2)
    assert (pusher.blocks, pusher.bytes, pusher.failures) == (12, 12 * LAYOUT.block_bytes, 0)
    pusher.close()


def test_push_sends_only_the_cached_prefix():
    sender, receiver = store(), store()
    keys = sender.keys(list(range(8 * 6)))
    sender.put(keys[:3], payload(keys[:3], LAYOUT.block_bytes))   # blocks 3-5 are not here
    with Node(receiver, "127.0.0.1:0", SECRET) as node:
        out = Pusher(SECRET).push(sender, keys, node.address)
    assert (out.blocks, out.sent, out.error) == (3, 3, "") and receiver.lookup(keys).blocks == 3


def test_a_receiver_that_is_gone_or_too_small_ends_the_push_early():
    sender = store()
    keys = sender.keys(list(range(8 * 10)))
    sender.put(keys, payload(keys, LAYOUT.block_bytes))
    t0 = time.monotonic()
    with Node(store(), "127.0.0.1:0", SECRET) as gone:
        address = gone.address
    out = Pusher(SECRET, timeout=0.5).push(sender, keys, address)
    assert out.blocks == 0 and out.error and time.monotonic() - t0 < 30     # a miss within its deadline, not a hang
    out = Pusher(SECRET).push(sender, keys, "127.0.0.1:0")          # no node listens on port 0: not dialled
    assert out.blocks == 0 and "port 0" in out.error
    # a PUT of more blocks than the receiver's top tier holds is refused (an ERR reply), and
    # the node goes on serving
    small = store(blocks=4)
    with Node(small, "127.0.0.1:0", SECRET) as node:
        pusher = Pusher(SECRET, chunk=8)
        out = pusher.push(sender, keys, node.address)
        assert out.blocks == 0 and "PUT refused" in out.error and pusher.failures == 1
        with PeerClient.for_store(small, node.address, SECRET, timeout=2) as c:
            rows = payload(keys[:2], LAYOUT.block_bytes).numpy()
            assert c.put(keys[:2], rows) == 2 and c.has(keys) == 2
            assert c.put(keys[2:4], rows, sums=[0, 0]) == 0        # blocks that do not match their checksums
            assert c.has(keys) == 2                                  # are never stored


def test_a_receiver_smaller_than_the_push_is_reported_as_holding_what_it_holds():
    """A receiver whose top tier (59 blocks) is smaller than the push evicts its first blocks
    to store the last: `blocks` is what it holds after the push (the prefill worker releases
    its copy only when that is all of them), never what was sent (it said 100 of 100 while
    the receiver held a prefix of 9)."""
    sender = store(blocks=128)
    keys = sender.keys(list(range(8 * 100)))
    sender.put(keys, payload(keys, LAYOUT.block_bytes))
    receiver = store(blocks=59)
    with Node(receiver, "127.0.0.1:0", SECRET) as node, \
            PeerClient.for_store(receiver, node.address, SECRET, timeout=2) as c:
        whole = Pusher(SECRET, chunk=50).push(sender, keys, node.address)
        assert (whole.sent, whole.error) == (100, "") and whole.blocks == c.has(keys) < 100
        part = Pusher(SECRET, chunk=20).push(sender, keys[:40], node.address)
        assert part.error == "" and part.blocks == c.has(keys[:40])


class GatedTier(kvtier.HostTier):
    """A host tier the store reads like a disk (no memory view: each read copies into a
    buffer), whose reads wait until the test opens its gate."""

    def __init__(self, blocks: int) -> None:
        super().__init__(blocks=blocks)
        self.gate, self.reading = threading.Event(), threading.Event()

    def memory(self):
        return None

    def read(self, slots, rows, idx=None, keys=None):
        self.reading.set()
        assert self.gate.wait(30), "the test never opened the gate"
        return super().read(slots, rows, idx, keys)


def test_a_get_waiting_on_a_slow_tier_leaves_the_node_answering_others():
    tier = GatedTier(16)
    st = kvtier.Store(LAYOUT, [tier], NS)
    keys = st.keys(list(range(8 * 4)))
    st.put(keys, payload(keys, LAYOUT.block_bytes))
    got = torch.zeros(4, LAYOUT.block_bytes, dtype=torch.uint8)
    with Node(st, "127.0.0.1:0", SECRET) as node:
        with PeerClient.for_store(st, node.address, SECRET, timeout=20) as slow, \
                PeerClient.for_store(st, node.address, SECRET, timeout=2) as quick:
            done = []
            t = threading.Thread(target=lambda: done.append(slow.get(keys, got.numpy())))
            t.start()
            assert tier.reading.wait(10)
            # the slow GET is inside the tier's read: the node still answers, and nothing more
            assert quick.has(keys) == 4 and quick.put(keys[:1], got[:1].numpy()) == 0 and not done
            tier.gate.set()
            t.join(20)
    assert done == [4] and torch.equal(got, payload(keys, LAYOUT.block_bytes))


def test_a_get_past_its_deadline_lets_go_of_what_it_held():
    tier = GatedTier(16)
    st = kvtier.Store(LAYOUT, [tier], NS)
    keys = st.keys(list(range(8 * 4)))
    st.put(keys, payload(keys, LAYOUT.block_bytes))
    with Node(st, "127.0.0.1:0", SECRET, request_timeout=0.3) as node:
        with PeerClient.for_store(st, node.address, SECRET, timeout=0.5) as c:
            with pytest.raises(PeerError):
                c.get(keys, torch.zeros(4, LAYOUT.block_bytes, dtype=torch.uint8).numpy())
        assert tier.reading.is_set()
        tier.gate.set()                 # the hold is entered only now, after the request is gone
        deadline = time.monotonic() + 10
        while any(st.index.entries[k].refs for k in keys):
            assert time.monotonic() < deadline, "the blocks stayed held"
            time.sleep(0.02)


def test_a_non_blocking_get_keeps_a_large_fetch_without_waiting_on_itself(monkeypatch):
    """A get on the store's one I/O thread that fetches a prefix from a peer puts it into
    the store; a put that large is pipelined (PIPELINE_HEAD_BYTES, shrunk to 2 blocks here),
    and its first part must not queue behind the get that made it."""
    import kvtier.store
    monkeypatch.setattr(kvtier.store, "PIPELINE_HEAD_BYTES", 2 * LAYOUT.block_bytes)
    holder = store()
    keys = holder.keys(list(range(8 * 8)))
    holder.put(keys, payload(keys, LAYOUT.block_bytes))
    with Node(holder, "127.0.0.1:0", SECRET) as node:
        local = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=64)], NS, io_threads=1,
                             remote=kvtier.Remote([node.address], SECRET, timeout=5))
        out = torch.zeros(8, LAYOUT.block_bytes, dtype=torch.uint8)
        t = local.get(keys, out, blocking=False).wait(timeout=30)
        assert t.loaded == 8 and torch.equal(out, payload(keys, LAYOUT.block_bytes))
        assert local.lookup(keys, local=True).blocks == 8          # kept, from one pipelined put
        local.close()
