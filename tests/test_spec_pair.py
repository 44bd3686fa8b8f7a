"""The text speculation is measured on (kvtier/bench/spec_text.py) and the script that trains a
target and draft pair on it (bench/spec_pair.py): documents are reproducible, prompts are never
training documents, a call copies its values from the prompt, and a trained pair loads in the
engine, with its tokenizer, as a target and its draft."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from kvtier.bench.spec_text import KINDS, document, prompt

REPO = Path(__file__).resolve().parents[1]


def test_documents_are_reproducible_and_prompts_are_their_starts():
    for kind in KINDS:
        assert document(kind, 3) == document(kind, 3) != document(kind, 4)
        p = prompt(kind, 7)
        assert document(kind, 2**31 + 7).startswith(p) and len(p) < len(document(kind, 2**31 + 7))
    assert prompt("tool", 0).endswith("<assistant>\n") and "<user>" in prompt("tool", 0)
    assert prompt("text", 0).count(". ") == 3 and prompt("text", 0).endswith(".")


def test_a_tool_call_copies_its_name_and_values_from_the_prompt():
    for seed in range(50):
        doc = document("tool", seed)
        head = doc[:doc.index("<assistant>")]
        lines = doc.splitlines()
        calls = [json.loads(after) for tag, after in zip(lines, lines[1:])
                 if tag == "<assistant>" and after.startswith("{")]
        assert calls
        for call in calls:
            assert f'"name": "{call["name"]}"' in head                 # offered in the system prompt
            for value in call["arguments"].values():
                assert str(value) in head.split("<user>")[1]           # asked for by the user


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    spec = importlib.util.spec_from_file_location("spec_pair", REPO / "bench" / "spec_pair.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path_factory.mktemp("pair")
    threads = torch.get_num_threads()
    try:
        assert mod.main(["--out", str(out), "--target-steps", "3", "--draft-steps", "3", "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    return out


def test_a_trained_pair_loads_with_its_tokenizer_and_speculates(pair):
    from kvtier import StoreConfig
    from kvtier.engine import LLM, SamplingParams
    from kvtier.engine.spec import SpeculativeConfig

    text = prompt("tool", 1)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    cache = StoreConfig(host_capacity=None)
    with LLM(str(pair / "target"), cache=cache) as llm:
        assert llm.tokenizer.name.startswith("tokenizers:") and llm.tokenizer.bos_token_id == 0
        assert llm.tokenizer.decode(llm.tokenizer.encode(text)) == text      # byte-level BPE: lossless
        plain = llm.generate(text, params)[0].token_ids
    draft = SpeculativeConfig(method="draft_model", model=str(pair / "draft"), num_speculative_tokens=3)
    with LLM(str(pair / "target"), cache=cache, speculative=draft) as llm:
        assert llm.generate(text, params)[0].token_ids == plain       # greedy: speculation changes no token
        assert llm.stats()["spec"]["draft_tokens"] > 0
