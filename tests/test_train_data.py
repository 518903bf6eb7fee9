"""train/data.py: ShareGPT records -> chat-template tokens, assistant mask, held-out split."""

import hashlib

import numpy as np
import pytest

from tests.train_data import sharegpt_records, write_sharegpt
from trt_spec.export.sharegpt import (Conversation, base_id, is_heldout, load_tokenizer,
                                      read_conversations, split)
from trt_spec.train.data import tokenize, tokenize_all


def test_reads_records_and_survives_a_cut_file(tmp_path):
    records = sharegpt_records(10)
    records.append({"id": "odd_0", "conversations": [{"from": "narrator", "value": "a"}]})
    records.append({"id": "mute_0", "conversations": [{"from": "human", "value": "a"}]})
    convs, report = read_conversations(write_sharegpt(tmp_path / "d.json", records, cut_tail=True))
    assert [c.id for c in convs] == [r["id"] for r in records[:10]]
    assert report.truncated_file and report.records == 12 and report.kept == 10
    assert report.skipped == {"unknown role": 1, "no assistant turn": 1}
    assert convs[0].messages[0]["role"] == "user" and convs[0].messages[1]["role"] == "assistant"
    whole, report = read_conversations(write_sharegpt(tmp_path / "e.json", records[:3]))
    assert not report.truncated_file and len(whole) == 3


def test_split_is_stable_disjoint_and_keeps_parts_together():
    ids = [f"conv{i}_{part}" for i in range(2000) for part in range(2)]
    convs = [Conversation(i, ()) for i in ids]
    train, heldout = split(convs, 0.1)
    assert {c.id for c in train}.isdisjoint({c.id for c in heldout})
    assert len(train) + len(heldout) == len(ids)
    assert 0.07 < len(heldout) / len(ids) < 0.13
    assert split(list(reversed(convs)), 0.1)[1] == list(reversed(heldout))  # order-free
    for c in heldout:  # both parts of a conversation on the same side
        assert is_heldout(base_id(c.id) + "_0", 0.1) and is_heldout(base_id(c.id) + "_1", 0.1)
    assert base_id("QWJhYvA_12") == "QWJhYvA" and base_id("plain") == "plain"
    # the documented rule, re-derived: first 8 bytes of sha256(base id) / 2**64 < fraction
    for i in range(50):
        digest = hashlib.sha256(f"conv{i}".encode()).digest()
        assert is_heldout(f"conv{i}_1", 0.1) == (int.from_bytes(digest[:8], "big") < 0.1 * 2**64)


def test_assistant_mask_marks_exactly_the_answers(tiny_hf_dir):
    tok = load_tokenizer(tiny_hf_dir)
    conv = Conversation("x_0", ({"role": "user", "content": "a b c"},
                                {"role": "assistant", "content": "w1 w2"},
                                {"role": "user", "content": "d"},
                                {"role": "assistant", "content": "w3"}))
    ex = tokenize(tok, conv, max_len=100)
    words = tok.decode(ex.input_ids.tolist(), skip_special_tokens=False).split()
    marked = [w for w, m in zip(words, ex.loss_mask) if m]
    assert marked == ["w1", "w2", "<|im_end|>", "w3", "<|im_end|>"]
    assert ex.input_ids.dtype == np.int32 and len(ex.input_ids) == len(ex.loss_mask)
    short = tokenize(tok, conv, max_len=9)  # cut inside the first answer
    assert len(short.input_ids) == 9
    np.testing.assert_array_equal(short.input_ids, ex.input_ids[:9])
    assert tokenize(tok, conv, max_len=5) is None  # no answer token left
    with pytest.raises(ValueError, match="max_len 1"):
        tokenize(tok, conv, max_len=1)


def test_tokenize_all_stops_near_the_token_budget(tiny_hf_dir, tmp_path):
    tok = load_tokenizer(tiny_hf_dir)
    convs, _ = read_conversations(write_sharegpt(tmp_path / "d.json", sharegpt_records(20)))
    examples = tokenize_all(tok, convs, max_len=64, max_tokens=150)
    sizes = [len(e.input_ids) for e in examples]
    assert sum(sizes[:-1]) < 150 <= sum(sizes)
    assert all(s <= 64 for s in sizes)
