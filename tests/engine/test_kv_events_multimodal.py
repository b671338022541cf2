"""KV cache events of an IMAGE prompt: the connector's tiers announce its blocks with the image's mm hash,
exactly as vLLM announces them on the GPU, and a router's indexer (NVIDIA Dynamo's standalone
``python -m dynamo.indexer``, the ``ai-dynamo-runtime`` dev dependency) then reports the host tier for the
prompt, whose resend loads exactly that many tokens. The text-model version of this, with LoRA, eviction,
restart and ``tiercache evict``, is tests/engine/test_kv_events_engine.py.

One server start: a real OpenAI server (BLIP-2, random weights; 8 image placeholder tokens, then the text)
running TieredKVConnector over memory + disk with ``--kv-events-config`` (zmq), vLLM's prefix cache on with
9 GPU blocks (one image prompt fills 8 of them); Dynamo's indexer and a raw subscriber in this process
(vLLM's ``KVEventBatch``, decoded with msgspec) both on the publisher. The module's fixture runs the
scenario once, the tests assert on what it saw:

- image 1, then image 2 with the same text (vLLM's GPU lets image 1 go), then a text prompt that fills the
  GPU (it lets image 2 go too);
- the connector's ``CPU`` and ``DISK`` events for image 1 are vLLM's own GPU events for it, block by block
  (hashes, parent links, tokens, ``extra_keys`` with the image's mm hash on block 0); image 2's blocks hash
  differently (the hash includes the image);
- Dynamo reports image 1's prompt on the host tier, not the GPU; the resend of image 1 loads exactly
  that (``cached_tokens``; the prompt's last token is always computed: 249 tokens, 7 blocks = 224);
- image 4, never sent, same text (asked before the resend): nothing is loaded for it (its block hashes
  are its own).

Dynamo 1.6.1's standalone indexer keys blocks by their tokens only: the mm hash of vLLM's events is not
used, for vLLM's GPU blocks as for ours (its ``/dump`` says ``mm_extra_info: null``), so to it two images
with the same text are one prefix. The last test records that (labelled as Dynamo's behaviour, not ours):
it matches image 4's prompt on this instance's host tier, though the connector has nothing for image 4.
"""

from __future__ import annotations

import json
import os
import threading
import urllib.request
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.ec.test_ec_metrics_server import _data_url
from tests.engine.test_kv_events_engine import Indexer, _until
from vllm_tiercache.tools.bench.router_index import events_config
from vllm_tiercache.tools.demo.prompts import CHAT_TEMPLATE
from vllm_tiercache.tools.demo.server import Server, free_port

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]
SERVED, BLOCK = "tiny-blip2", 32
TEXT = ("Question: describe every object that you can see in this picture, one by one, in great detail, and say"
        " where each one is, what colour it has, how big it is, and whether it is moving or still, and then say"
        " what the weather looks like. Answer:")
PROMPT_TOKENS = 249  # 8 image placeholders + TEXT
PREFIX = 7 * BLOCK  # the full blocks of such a prompt: what the connector can give of it, and a router match
# a text prompt of 8 blocks (with its 4 new tokens): vLLM's 8 usable GPU blocks then hold nothing else
FLUSH = ("Tell me a long story about a lighthouse keeper who lives alone on a rocky island,"
         " who counts the ships that pass each night, who writes letters that he never sends, and who one"
         " stormy winter finds a small boat washed up on the shore below.")


def _chat(server: Server, text: str, image: int | None = None) -> dict[str, int]:
    """A chat request (4 new tokens), with image ``image`` before ``text``; its prompt tokens and the
    prompt tokens vLLM did not compute (``cached_tokens``)."""
    content: Any = text if image is None else [
        {"type": "image_url", "image_url": {"url": _data_url(image)}}, {"type": "text", "text": text}]
    body = {"model": SERVED, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True,
            "messages": [{"role": "user", "content": content}]}
    req = urllib.request.Request(server.base_url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        usage = json.loads(resp.read())["usage"]
    return {"prompt": int(usage["prompt_tokens"]),
            "cached": int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)}


@dataclass(frozen=True)
class Block:
    """One block of a `BlockStored` event, as its medium announced it."""

    hash: int
    parent: int | None
    tokens: tuple[int, ...]
    extra: Any  # the block's extra_keys entry: ((mm hash, offset), ...) or None


class Recorder:
    """Every event the server publishes, as vLLM's own `KVEventBatch` type decodes it (a zmq SUB thread)."""

    def __init__(self, zmq_port: int) -> None:
        self.events: list[Any] = []
        self.errors: list[BaseException] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(zmq_port,), daemon=True, name="kv-events")
        self._thread.start()
        self._ready.wait(10)

    def _run(self, zmq_port: int) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        ctx = zmq.Context()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.RCVTIMEO, 200)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(f"tcp://127.0.0.1:{zmq_port}")
        self._ready.set()
        try:
            while not self._stop.is_set():
                try:
                    parts = sock.recv_multipart()  # topic, sequence number, payload
                except zmq.Again:
                    continue
                try:
                    batch = decoder.decode(parts[-1])
                except Exception as exc:  # a test asserts there is none
                    self.errors.append(exc)
                    continue
                with self._lock:
                    self.events.extend(batch.events)
        finally:
            sock.close(linger=0)
            ctx.term()

    def stored(self, medium: str) -> dict[int, Block]:
        """Every block announced in ``medium`` so far, by hash, in order of first announcement."""
        blocks: dict[int, Block] = {}
        with self._lock:
            events = list(self.events)
        for event in events:
            if type(event).__name__ != "BlockStored" or event.medium != medium:
                continue
            parent = event.parent_block_hash
            for i, block_hash in enumerate(event.block_hashes):
                extra = event.extra_keys[i] if event.extra_keys else None
                tokens = tuple(event.token_ids[i * event.block_size:(i + 1) * event.block_size])
                blocks.setdefault(block_hash, Block(block_hash, parent, tokens, extra))
                parent = block_hash
        return blocks

    def removed(self, medium: str) -> set[int]:
        with self._lock:
            return {h for e in self.events if type(e).__name__ == "BlockRemoved" and e.medium == medium
                    for h in e.block_hashes}

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _images(gpu: dict[int, Block]) -> list[str]:
    """The mm hashes of the image prompts vLLM's GPU cached, in order: block 0's first extra key."""
    return [b.extra[0][0] for b in gpu.values() if b.parent is None and b.extra]


def _chain(blocks: dict[int, Block], mm_hash: str) -> list[Block]:
    """The blocks of the image prompt whose first block carries ``mm_hash``, root first, by parent links."""
    children: dict[int | None, list[Block]] = defaultdict(list)
    for block in blocks.values():
        children[block.parent].append(block)
    roots = [b for b in children[None] if b.extra and b.extra[0][0] == mm_hash]
    chain = roots[:1]
    while chain and children.get(chain[-1].hash):
        kids = children[chain[-1].hash]
        assert len(kids) == 1, kids  # one prompt per root in this scenario
        chain.append(kids[0])
    return chain


def _server(model: Path, work: Path, zmq_port: int) -> Server:
    template = work / "template.jinja"
    template.write_text(CHAT_TEMPLATE)
    store = {"namespace": "mm-events", "chunk_size": BLOCK, "tiers": [
        {"kind": "memory", "capacity": "64MiB"},
        {"kind": "disk", "path": str(work / "disk"), "capacity": "1GiB"},
    ]}
    kv = {"kv_connector": "TieredKVConnector", "kv_connector_module_path": "vllm_tiercache.kvcache.connector",
          "kv_role": "kv_both", "kv_connector_extra_config": store}
    server = Server(model, work / "server.log", served_name=SERVED, chat_template=template, max_model_len=256,
                    kv_transfer=kv, extra_args=[
                        "--enable-prefix-caching", "--num-gpu-blocks-override", "9",
                        "--kv-events-config", json.dumps(events_config(zmq_port))])
    server.env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), server.env.get("PYTHONPATH")) if p)
    return server


def _warm_up(server: Server, recorder: Recorder, indexer: Indexer) -> None:
    """Until the recorder and Dynamo both got a GPU block of a fresh text prompt (a zmq subscriber misses
    what was published before its subscription reached the publisher)."""
    for i in range(60):
        _chat(server, f"{i:02d} warm-up request of this test; " * 2)
        roots = [b for b in recorder.stored("GPU").values() if b.parent is None]
        if roots and indexer.query(list(roots[-1].tokens))["gpu"] >= BLOCK:
            return
    raise AssertionError(f"Dynamo and the subscriber never saw a GPU block; see {server.log_path.parent}")


@pytest.fixture(scope="module")
def seen(tiny_blip2: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run the scenario of the module docstring once; what the subscriber, Dynamo and the server said."""
    work = tmp_path_factory.mktemp("kv-events-mm")
    zmq_port = free_port()
    seen: dict[str, Any] = {"logs": work}
    with _server(tiny_blip2, work, zmq_port) as server:
        server.wait_healthy(timeout_s=300)
        recorder = Recorder(zmq_port)
        indexer = Indexer(zmq_port, work / "indexer.log", model_name=SERVED)
        try:
            _warm_up(server, recorder, indexer)

            def nudge() -> None:  # events go out only on engine steps
                _chat(server, "a short request that only makes the engine step")

            seen["image1"] = _chat(server, TEXT, image=1)
            seen["image2"] = _chat(server, TEXT, image=2)  # 8 blocks: vLLM's GPU lets image 1 go
            _until(lambda: {"n": len(_images(recorder.stored("GPU")))}, lambda q: q["n"] >= 2, lambda: None,
                   timeout_s=15)
            mm1, mm2 = [*_images(recorder.stored("GPU")), "?", "?"][:2]
            tokens = [t for b in _chain(recorder.stored("GPU"), mm1) for t in b.tokens]
            seen["tokens"] = tokens
            # what Dynamo answers for image 1's tokens while vLLM's GPU holds image 2 (same text), not image 1
            seen["dynamo_gpu_holds_image2"] = _until(lambda: indexer.query(tokens), lambda q: q["gpu"] >= PREFIX,
                                                     lambda: None, timeout_s=15)
            seen["flush"] = _chat(server, FLUSH)  # 8 blocks of other tokens: nothing of TEXT on the GPU now
            seen["gpu_let_go"] = _until(lambda: indexer.query(tokens), lambda q: q["cpu"] >= PREFIX > q["gpu"],
                                        nudge)
            # the disk tier is announced off the step (a shared-tier lookup): wait for all of image 1's blocks
            _until(lambda: {"n": len(_chain(recorder.stored("DISK"), mm1))}, lambda q: q["n"] >= PREFIX // BLOCK,
                   nudge)
            seen["gpu_removed"] = recorder.removed("GPU")
            # what Dynamo's answer would route here: image 4, never sent, whose token ids are image 1's
            seen["image4"] = _chat(server, TEXT, image=4)
            seen["resend"] = _chat(server, TEXT, image=1)
            _until(lambda: {"n": len(_images(recorder.stored("GPU")))}, lambda q: q["n"] >= 3, nudge)
        finally:
            indexer.stop()
            recorder.stop()
        seen["mm"] = _images(recorder.stored("GPU"))
        seen["media"] = {m: recorder.stored(m) for m in ("GPU", "CPU", "DISK")}
        seen["decode_errors"] = recorder.errors
        seen["mm1"], seen["mm2"] = mm1, mm2
    return seen


def test_the_scenario_is_what_the_tests_assume(seen: dict[str, Any]) -> None:
    assert seen["decode_errors"] == []
    assert seen["image1"]["prompt"] == PROMPT_TOKENS and seen["image1"]["cached"] == 0, seen["image1"]
    assert seen["image2"] == {"prompt": PROMPT_TOKENS, "cached": 0}
    assert seen["flush"]["prompt"] + 3 > PREFIX, seen["flush"]  # it needs all 8 of vLLM's usable GPU blocks
    assert seen["flush"]["prompt"] + 4 <= 256, seen["flush"]  # within --max-model-len
    mm = seen["mm"]
    assert len(mm) == 3 and len(set(mm)) == 3 and [mm[0], mm[1]] == [seen["mm1"], seen["mm2"]], mm
    assert all(len(h) == 64 and set(h) <= set("0123456789abcdef") for h in mm), mm  # vLLM's hex mm hashes
    assert len(seen["tokens"]) == PREFIX and seen["tokens"][:8] == seen["tokens"][:1] * 8, seen["tokens"]
    # vLLM's GPU let image 1 go: every block of it was removed there before the resend
    gpu_chain = _chain(seen["media"]["GPU"], seen["mm1"])
    assert {b.hash for b in gpu_chain} <= seen["gpu_removed"]


@pytest.mark.parametrize("medium", ["CPU", "DISK"])
def test_the_tier_events_of_an_image_prompt_are_vllms_gpu_events_with_its_mm_hash(
        seen: dict[str, Any], medium: str) -> None:
    gpu = _chain(seen["media"]["GPU"], seen["mm1"])
    ours = _chain(seen["media"][medium], seen["mm1"])
    assert len(gpu) == PREFIX // BLOCK, (gpu, seen["logs"])
    assert ours == gpu, (medium, ours, gpu)  # hashes, parent links, tokens and extra_keys, block by block
    assert ours[0].parent is None and ours[0].extra == gpu[0].extra
    assert [list(pair) for pair in ours[0].extra] == [[seen["mm1"], 0]]  # the image starts at block 0's token 0
    assert all(b.extra is None for b in ours[1:])


def test_the_same_text_with_another_image_hashes_to_other_blocks(seen: dict[str, Any]) -> None:
    one = _chain(seen["media"]["CPU"], seen["mm1"])
    two = _chain(seen["media"]["CPU"], seen["mm2"])
    assert len(one) == len(two) == PREFIX // BLOCK
    assert [b.tokens for b in one] == [b.tokens for b in two]  # the same token ids ...
    assert not {b.hash for b in one} & {b.hash for b in two}  # ... and no block hash in common
    assert [list(pair) for pair in two[0].extra] == [[seen["mm2"], 0]]


def test_dynamo_reports_the_prompts_tokens_on_the_host_tier_and_a_resend_loads_exactly_that(
        seen: dict[str, Any]) -> None:
    """Dynamo keys by tokens only (last test), so its host-tier match is for this text after an image: image 1's
    own blocks on the host tier are proven by the raw events above, the resend's load by ``cached_tokens``."""
    tiers = seen["gpu_let_go"]
    assert tiers["gpu"] < PREFIX <= tiers["cpu"], (tiers, seen["logs"])
    assert tiers["cpu"] == PREFIX  # never more than the connector can give
    assert seen["resend"] == {"prompt": PROMPT_TOKENS, "cached": tiers["cpu"]}


def test_an_image_never_sent_with_the_same_text_loads_nothing(seen: dict[str, Any]) -> None:
    assert seen["image4"] == {"prompt": PROMPT_TOKENS, "cached": 0}, seen["image4"]
    image4 = _chain(seen["media"]["GPU"], seen["mm"][2])
    assert [t for b in image4 for t in b.tokens] == seen["tokens"]  # image 1's token ids, other block hashes
    assert not {b.hash for b in image4} & {b.hash for b in _chain(seen["media"]["GPU"], seen["mm1"])}


def test_dynamo_1_6_1_standalone_indexer_ignores_the_mm_hash(seen: dict[str, Any]) -> None:
    """Dynamo's behaviour, recorded, not this project's contract: its standalone indexer keys vLLM's events
    by their tokens only, so image 2 on the GPU answers for image 1, and image 1 on the host tier answers for
    image 4, which the connector does not hold."""
    assert seen["dynamo_gpu_holds_image2"]["gpu"] == PREFIX, seen["dynamo_gpu_holds_image2"]
    image4 = _chain(seen["media"]["GPU"], seen["mm"][2])
    assert [t for b in image4 for t in b.tokens] == seen["tokens"]  # so its query is image 1's query: ...
    assert seen["gpu_let_go"]["cpu"] == PREFIX > seen["gpu_let_go"]["gpu"]  # ... a host-tier match ...
    assert seen["image4"]["cached"] == 0  # ... where the connector holds nothing of image 4
