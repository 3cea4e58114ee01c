"""Row formats (text, messages, prompt_completion, input_ids), assistant-only masking, Hugging Face
datasets sources, and the errors that name the file and line. Tokenizer and chat template are built
in the test (tests/support/chat_data.py): no download."""

from __future__ import annotations

import json

import pytest
import torch

from tests.support.chat_data import (
    CHATML,
    CHATML_GENERATION,
    conversations,
    make_chat_tokenizer,
    reference_encoder,
    write_jsonl,
)
from xorl.config import DataConfig
from xorl.data.corpus import DataError
from xorl.data.loader import PackedDataset
from xorl.data.packing import IGNORE_INDEX, DataCounts, pack_documents


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    return make_chat_tokenizer(tmp_path_factory.mktemp("tok"))


def _expected_chat(messages, assistant_only=True):
    """ids and unshifted labels of a ChatML conversation by the test's own byte rule."""
    encode, special = reference_encoder()
    ids, labels = [], []
    for m in messages:
        head = [special["<|im_start|>"]] + encode(f"{m['role']}\n")
        body = encode(m["content"]) + [special["<|im_end|>"]] + encode("\n")
        ids += head + body
        trained = m["role"] == "assistant" or not assistant_only
        labels += (head if not assistant_only else [IGNORE_INDEX] * len(head)) + \
            (body if trained else [IGNORE_INDEX] * len(body))
    return ids, labels


def _targets(ids, labels):
    """What a packed sequence carries for one whole document: the next token's label."""
    return labels[1:] + [IGNORE_INDEX]


@pytest.mark.parametrize("template", [CHATML, CHATML_GENERATION], ids=["incremental", "generation-marks"])
@pytest.mark.parametrize("train_on", ["assistant", "all"])
def test_messages_mask_exactly_the_assistant_tokens(tmp_path, template, train_on):
    tok = make_chat_tokenizer(tmp_path / "tok", template)
    chats = conversations(5, seed=1, turns=2) + [[{"role": "system", "content": "be brief"}] + conversations(1, 2)[0]]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in chats])
    ds = PackedDataset(DataConfig(dataset=path, tokenizer=tok, seq_len=128, packing=False, train_on=train_on))
    assert ds.encoder.format == "messages" and "auto" in ds.encoder.describe()
    assert len(ds) == len(chats)  # packing off: one conversation per sequence, in file order
    for seq, messages in zip(ds.sequences, chats):
        ids, labels = _expected_chat(messages, assistant_only=train_on == "assistant")
        n = len(ids)
        assert seq.input_ids[:n].tolist() == ids
        assert seq.labels[:n].tolist() == _targets(ids, labels)
        assert (seq.labels[n:] == IGNORE_INDEX).all()


def test_prompt_completion_and_input_ids(tmp_path):
    encode, _ = reference_encoder()
    tok = make_chat_tokenizer(tmp_path / "tok")
    eos = 258
    pc = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "2+2=", "completion": "4"},
                                             {"prompt": "x", "completion": "yz"}])
    for train_on in ("assistant", "all"):
        ds = PackedDataset(DataConfig(dataset=pc, tokenizer=tok, seq_len=16, packing=False, train_on=train_on))
        assert ds.encoder.format == "prompt_completion"
        ids = encode("2+2=") + encode("4") + [eos]
        labels = ([IGNORE_INDEX] * 4 if train_on == "assistant" else encode("2+2=")) + encode("4") + [eos]
        assert ds.sequences[0].input_ids[:6].tolist() == ids
        assert ds.sequences[0].labels[:6].tolist() == _targets(ids, labels)
    rows = [{"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]}, {"input_ids": [9, 10, 11]}]
    path = write_jsonl(tmp_path / "ids.jsonl", rows)
    ds = PackedDataset(DataConfig(dataset=path, tokenizer=tok, seq_len=8, packing=True))
    assert ds.encoder.format == "input_ids"
    seq = ds.sequences[0]  # both whole documents in one sequence
    assert seq.input_ids[:7].tolist() == [5, 6, 7, 8, 9, 10, 11] and seq.doc_lengths == [4, 3, 1]
    assert seq.labels.tolist() == [-100, 7, 8, -100, 10, 11, -100, -100]


def test_rows_that_train_on_nothing_are_counted_and_left_out_and_long_rows_are_cut(tmp_path, capsys):
    tok = make_chat_tokenizer(tmp_path / "tok")
    rows = [{"input_ids": [1, 2, 3], "labels": [-100, -100, -100]},  # all masked
            {"input_ids": [4]},  # one token: nothing to predict
            {"input_ids": list(range(10, 30)), "labels": [-100] * 10 + list(range(20, 30))},  # longer than seq_len
            {"input_ids": [7, 8, 9]}]
    path = write_jsonl(tmp_path / "ids.jsonl", rows)
    ds = PackedDataset(DataConfig(dataset=path, tokenizer=tok, seq_len=8))
    assert (ds.counts.rows, ds.counts.untrained_rows, ds.counts.split_rows, ds.counts.untrained_pieces) == (4, 2, 1, 1)
    report = "\n".join(ds.report())
    assert "2 of 4 rows train on no token" in report and "1 rows are longer than data.seq_len=8" in report
    assert "sees none of the text before it: raise data.seq_len" in report  # a cut chat loses its prompt: said
    kept = [t for s in ds.sequences for t in s.input_ids.tolist() if t != tok_pad(tok)]
    # the first piece (10..17) is all prompt and is left out; the rest of the long row, then [7, 8, 9] whole
    assert kept == list(range(18, 30)) + [7, 8, 9]
    trained = sum(int((s.labels != IGNORE_INDEX).sum()) for s in ds.sequences)
    assert trained == 10 + 2  # 20..29 predicted (the cut restarts at 18: 19's target 19 is masked) + 8, 9


def tok_pad(folder: str) -> int:
    from xorl.data.tokenizer import build_tokenizer

    return build_tokenizer(folder).pad_id


def test_whole_documents_never_cross_a_sequence_boundary():
    docs = [(list(range(1, n + 1)), None) for n in (5, 4, 6, 3, 8)]
    seqs = pack_documents(docs, seq_len=8, pad_id=0, whole_documents=True)
    pieces = [n for s in seqs for n in s.doc_lengths]
    assert [s.doc_lengths for s in seqs] == [[5, 3], [4, 4], [6, 2], [3, 5], [8]]  # pads fill the rest
    assert sum(pieces) == 8 * len(seqs)
    counts = DataCounts()
    assert pack_documents([(list(range(20)), None)], 8, 0, whole_documents=True, counts=counts)
    assert counts.split_rows == 1


def test_auto_detection_and_errors_name_the_file_and_line(tmp_path, chat_tokenizer):
    for rows, fmt in (([{"text": "a b"}], "text"), ([{"messages": conversations(1, 0)[0]}], "messages"),
                      ([{"prompt": "a", "completion": "b"}], "prompt_completion"),
                      ([{"input_ids": [1, 2]}], "input_ids")):
        path = write_jsonl(tmp_path / f"{fmt}.jsonl", rows)
        assert PackedDataset(DataConfig(dataset=path, tokenizer=chat_tokenizer, seq_len=64)).encoder.format == fmt
    path = write_jsonl(tmp_path / "mixed.jsonl", [{"messages": conversations(1, 0)[0]}, {"text": "hello"}])
    with pytest.raises(DataError, match=r"mixed.jsonl:2: no key 'messages' \(keys: \['text'\]\); data.format is "
                                        r"messages \(detected from the first row\)"):
        PackedDataset(DataConfig(dataset=path, tokenizer=chat_tokenizer, seq_len=64))
    path = write_jsonl(tmp_path / "odd.jsonl", [{"question": "?"}])
    with pytest.raises(DataError, match=r"odd.jsonl:1: data.format auto cannot tell"):
        PackedDataset(DataConfig(dataset=path, tokenizer=chat_tokenizer, seq_len=64))
    (tmp_path / "bad.jsonl").write_text(json.dumps({"messages": conversations(1, 0)[0]}) + "\n\n"
                                        + json.dumps({"messages": [{"role": "user"}]}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl:3: messages\[0\] must be an object with a string 'role' and"):
        PackedDataset(DataConfig(dataset=str(tmp_path / "bad.jsonl"), tokenizer=chat_tokenizer, seq_len=64))
    path = write_jsonl(tmp_path / "ids.jsonl", [{"input_ids": [1, 2]}, {"input_ids": [1, 2], "labels": [1]}])
    with pytest.raises(DataError, match=r"ids.jsonl:2: 'labels' has 1 entries and 'input_ids' 2"):
        PackedDataset(DataConfig(dataset=path, tokenizer=chat_tokenizer, seq_len=64))


def test_messages_without_a_chat_template_is_refused_up_front(tmp_path):
    from xorl.config import Config, ConfigError

    tok = make_chat_tokenizer(tmp_path / "tok", template=None)
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in conversations(3, 0)])
    config = Config()
    config.model.vocab_size = 272
    config.data.dataset, config.data.tokenizer = path, tok
    with pytest.raises(ConfigError, match=r"the rows of .*chat.jsonl' are 'messages', which are rendered with the "
                                          r"tokenizer's chat template, and data.tokenizer=.* has none"):
        config.validate(1)
    config.data.format = "messages"
    with pytest.raises(ConfigError, match=r"data.format: messages, which"):
        config.validate(1)


def test_a_template_that_rewrites_earlier_turns_is_named(tmp_path):
    # Drops the earlier assistant replies (as some reasoning templates do): no incremental prefixes.
    template = ("{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}<|im_start|>{{ m['role'] }}\n"
                "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok = make_chat_tokenizer(tmp_path / "tok", template)
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": conversations(1, 0, turns=2)[0]}])
    with pytest.raises(DataError, match=r"chat.jsonl:1: the chat template does not render this conversation turn by "
                                        r"turn .*generation"):
        PackedDataset(DataConfig(dataset=path, tokenizer=tok, seq_len=128))


def test_datasets_save_to_disk_parquet_and_csv(tmp_path, chat_tokenizer):
    datasets = pytest.importorskip("datasets")
    chats = conversations(6, seed=3)
    jsonl = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in chats])
    reference = PackedDataset(DataConfig(dataset=jsonl, tokenizer=chat_tokenizer, seq_len=64))
    data = datasets.Dataset.from_list([{"messages": m} for m in chats])
    data.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": data, "test": data.select(range(2))}).save_to_disk(str(tmp_path / "dict"))
    data.to_parquet(str(tmp_path / "chat.parquet"))
    for source, split in ((tmp_path / "saved", None), (tmp_path / "dict", "train"), (tmp_path / "dict", None),
                          (tmp_path / "chat.parquet", None)):
        ds = PackedDataset(DataConfig(dataset=str(source), tokenizer=chat_tokenizer, seq_len=64, split=split))
        assert ds.encoder.format == "messages" and len(ds) == len(reference)
        for a, b in zip(ds.sequences, reference.sequences):
            assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
    test = PackedDataset(DataConfig(dataset=str(tmp_path / "dict"), tokenizer=chat_tokenizer, seq_len=64, split="test"))
    assert test.counts.rows == 2
    with pytest.raises(DataError, match=r"data.split='dev': .* has the splits \['test', 'train'\]"):
        PackedDataset(DataConfig(dataset=str(tmp_path / "dict"), tokenizer=chat_tokenizer, seq_len=64, split="dev"))
    with pytest.raises(DataError, match=r"data.split='train': .*saved' holds one dataset, not a DatasetDict"):
        PackedDataset(DataConfig(dataset=str(tmp_path / "saved"), tokenizer=chat_tokenizer, seq_len=64, split="train"))
    # an eval dataset's split defaults to 'validation'; a DatasetDict without one is named
    evaluation = DataConfig(dataset=str(tmp_path / "saved"), tokenizer=chat_tokenizer, seq_len=64,
                            eval_dataset=str(tmp_path / "dict"))
    with pytest.raises(DataError, match=r"data.split='validation': .* has the splits \['test', 'train'\]"):
        PackedDataset(evaluation, part="eval")
    evaluation.eval_split = "test"
    assert PackedDataset(evaluation, part="eval").counts.rows == 2
    (tmp_path / "pc.csv").write_text("prompt,completion\n1+1=,two\n2+2=,four\n")
    ds = PackedDataset(DataConfig(dataset=str(tmp_path / "pc.csv"), tokenizer=chat_tokenizer, seq_len=16))
    assert ds.encoder.format == "prompt_completion" and ds.counts.rows == 2


def test_eval_fraction_holds_out_rows_never_trained_on(tmp_path, chat_tokenizer):
    chats = conversations(200, seed=4)
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in chats])
    config = DataConfig(dataset=path, tokenizer=chat_tokenizer, seq_len=64, packing=False, eval_fraction=0.1)
    train, held = PackedDataset(config), PackedDataset(config, part="eval")
    assert train.counts.rows + held.counts.rows == 200 and 5 <= held.counts.rows <= 40
    rows = lambda ds: {tuple(s.input_ids.tolist()) for s in ds.sequences}  # noqa: E731
    assert not rows(train) & rows(held) or len({json.dumps(c) for c in chats}) < 200  # no row in both
    again = PackedDataset(config, part="eval")  # deterministic
    assert [s.input_ids.tolist() for s in again.sequences] == [s.input_ids.tolist() for s in held.sequences]


def test_data_and_eval_settings_are_checked_up_front(tmp_path):
    from xorl.config import ConfigError, load_config

    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "hello there"}])

    def problems(*overrides) -> str:
        try:
            load_config(None, [f"--train.output_dir={tmp_path / 'out'}", *overrides]).validate(1)
        except ConfigError as e:
            return str(e)
        return ""

    assert "train.eval_steps=5 but there is no eval data" in problems("--train.eval_steps=5")
    assert "train.eval_steps is 0, so it would never be evaluated" in problems("--data.eval_fraction=0.1")
    assert "use one eval source" in problems(f"--data.eval_dataset={path}", "--data.eval_fraction=0.1",
                                             "--train.eval_steps=2")
    assert "data.eval_fraction=1.5 must be in [0, 1)" in problems("--data.eval_fraction=1.5", "--train.eval_steps=2")
    assert "full read of the stream" in problems(f"--data.dataset={path}", "--data.streaming=true",
                                                 "--data.eval_fraction=0.1", "--train.eval_steps=2")
    assert "data.split='test': " in problems(f"--data.dataset={path}", "--data.split=test")
    assert "applies to messages and prompt_completion rows" in problems("--data.format=text", "--data.train_on=all")
    assert "data.eval_dataset='missing.jsonl': no such file" in problems("--data.eval_dataset=missing.jsonl",
                                                                         "--train.eval_steps=2")
    assert "zero-bubble schedules still run their backward actions" in problems(
        "--data.eval_fraction=0.1", "--train.eval_steps=2", "--train.pipeline_parallel_size=2",
        "--train.pipeline_parallel_schedule=ZBVZeroBubble", "--train.virtual_pipeline_stages=2",
        "--train.gradient_accumulation_steps=2", "--model.tie_word_embeddings=false")
    assert problems(f"--data.dataset={path}", "--data.eval_fraction=0.5", "--train.eval_steps=2") == ""
    assert problems("--data.dataset=HuggingFaceH4/ultrachat_200k", "--data.split=train_sft") == ""  # a hub name


def test_the_plot_draws_the_eval_curve_and_the_console_line_shows_it(tmp_path):
    pytest.importorskip("matplotlib")
    from xorl.cli.plot_metrics import main
    from xorl.observability.metrics import format_step_line

    rows = [{"step": s, "time": s, "loss": 3.0 - 0.1 * s, "grad_norm": 1.0, "lr": 1e-3} for s in range(1, 7)]
    for row in rows[1::2]:
        row.update(eval_loss=row["loss"] + 0.2, eval_ppl=2.718281828 ** (row["loss"] + 0.2))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    main([str(tmp_path), "--out", str(tmp_path / "plot.png")])
    assert (tmp_path / "plot.png").stat().st_size > 1000
    line = format_step_line(rows[1], 6)
    assert line.startswith("step 2/6 ") and "loss 2.8000 eval_loss 3.0000 eval_ppl 20.1" in line, line
    main([str(tmp_path), "--keys", "eval_loss", "--out", str(tmp_path / "eval.png")])  # the eval curve alone
    assert (tmp_path / "eval.png").is_file()


def test_resume_refuses_a_change_of_what_the_rows_train_on():
    from xorl.run.resume import _kind

    for key in ("format", "train_on", "split", "eval_fraction"):  # they change the packed training sequences
        assert _kind(f"data.{key}") == "fixed", key
    for key in ("eval_dataset", "eval_split"):  # validation only: the training order is unchanged
        assert _kind(f"data.{key}") == "applied", key
