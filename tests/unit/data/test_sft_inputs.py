"""Chat / SFT data as users bring it, and the rows that must be refused with one message naming the
file, the line and the fix (not trained on silently): a reply under another role name, an empty
conversation, other trainers' row shapes (alpaca, ShareGPT)."""

from __future__ import annotations

import json
import re

import pytest

from tests.support.chat_data import conversations, make_chat_tokenizer, reference_encoder, write_jsonl
from xorl.config import DataConfig
from xorl.data.corpus import DataError
from xorl.data.loader import PackedDataset
from xorl.data.packing import IGNORE_INDEX


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    return make_chat_tokenizer(tmp_path_factory.mktemp("tok"))


def _dataset(path, tok, **data):
    return PackedDataset(DataConfig(dataset=str(path), tokenizer=tok, seq_len=128, packing=False, **data))


@pytest.mark.parametrize("role, meant", [("gpt", "assistant"), ("Assistant", "assistant"), ("human", "user"),
                                         ("narrator", None)])
def test_a_turn_under_an_unknown_role_is_refused_naming_the_row_and_the_role_it_means(tmp_path, chat_tokenizer,
                                                                                      role, meant):
    """Before: the template rendered 'gpt' like any role and its reply was never the assistant's, so the
    row trained on nothing (or, every row so, 'produced no tokens that train' with no reason)."""
    chats = conversations(3, seed=4)
    chats[1][1 if meant != "user" else 0]["role"] = role
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in chats])
    index = 1 if meant != "user" else 0
    fix = f"rename it to {meant!r}" if meant else "rename it to one of them"
    with pytest.raises(DataError, match=rf"chat.jsonl:2: messages\[{index}\] has role {role!r}, not a chat role "
                                        rf".*'assistant'.*; {fix}"):
        _dataset(path, chat_tokenizer)
    for train_on in ("assistant", "all"):  # with every token trained the row is still refused: nothing is silent
        with pytest.raises(DataError, match=r"chat.jsonl:2: messages"):
            _dataset(path, chat_tokenizer, train_on=train_on)
    if meant is None:
        return
    chats[1][index]["role"] = meant  # renamed as the message says: the reply trains, by the test's own encoding
    ds = _dataset(write_jsonl(tmp_path / "fixed.jsonl", [{"messages": m} for m in chats]), chat_tokenizer)
    encode, special = reference_encoder()
    reply = encode(chats[1][1]["content"]) + [special["<|im_end|>"]] + encode("\n")
    labels = ds.sequences[1].labels
    assert labels[labels != IGNORE_INDEX].tolist() == reply


def test_an_empty_conversation_is_refused_as_empty(tmp_path, chat_tokenizer):
    rows = [{"messages": m} for m in conversations(2, seed=5)]
    path = write_jsonl(tmp_path / "chat.jsonl", rows[:1] + [{"messages": []}] + rows[1:])
    with pytest.raises(DataError, match=r"chat.jsonl:2: 'messages' is an empty conversation; remove the row"):
        _dataset(path, chat_tokenizer)


def test_alpaca_and_sharegpt_rows_are_named_with_the_shape_xorl_reads(tmp_path, chat_tokenizer):
    alpaca = tmp_path / "alpaca.json"
    alpaca.write_text(json.dumps([{"instruction": "Add one", "input": "3", "output": "4"}]))
    with pytest.raises(DataError, match=r"alpaca.json row 0: .*these are alpaca rows .*'prompt' .* \+ 'completion'"):
        _dataset(alpaca, chat_tokenizer)
    share = write_jsonl(tmp_path / "share.jsonl", [{"conversations": [{"from": "human", "value": "hi"},
                                                                     {"from": "gpt", "value": "hello"}]}])
    with pytest.raises(DataError, match=r"share.jsonl:1: .*ShareGPT rows .*'human' -> 'user', 'gpt' -> 'assistant'"):
        _dataset(share, chat_tokenizer)
    with pytest.raises(DataError, match=r"share.jsonl:1: no key 'messages' .*data.format is messages; these are "
                                        r"ShareGPT rows"):  # the format set, not guessed: the same fix
        _dataset(share, chat_tokenizer, format="messages")


@pytest.mark.slow  # starts processes (runs xorl-train and torchrun): the full suite's, not the quick tier's
def test_the_command_line_refuses_a_bad_row_in_one_line_before_any_process_group(tmp_path, chat_tokenizer):
    """What a user sees: one line naming file:line and the fix, no traceback, no run folder written; the
    in-memory data is read before start-up (it was read inside the trainer, after the process group
    started), so `--check` finds the row too and torchrun's ranks stop before any collective."""
    from tests.support.cli_runs import torchrun, write_config, xorl_train

    chats = conversations(40, seed=6)
    chats[30][1]["role"] = "gpt"
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in chats])
    config = write_config(tmp_path, "out", data_parallel_mode="fsdp2")
    args = [f"--data.dataset={data}", f"--data.tokenizer={chat_tokenizer}", "--model.vocab_size=259"]
    for got in (xorl_train(config, *args, "--check", "--world-size=2", cwd=tmp_path),
                torchrun(2, config, *args, cwd=tmp_path)):
        assert got.code == 2 or (got.code != 0 and "(exitcode: 2)" in got.text), got.text  # xorl's config-error exit
        lines = [line for line in got.text.splitlines() if line.startswith("xorl-train")]
        # "xorl-train:" is the message printed before start-up; after it, "xorl-train (rank r):"
        assert len(lines) == 1 and lines[0].startswith("xorl-train: ") and \
            "chat.jsonl:31: messages[1] has role 'gpt'" in lines[0], got.text
        assert not re.search(r'File ".*/xorl/', got.text), got.text  # no traceback through xorl (torchrun's own: yes)
        assert not (tmp_path / "out").exists()
    # The eval set (read by the evaluator after start-up before): the same, through data.eval_dataset.
    good = write_jsonl(tmp_path / "good.jsonl", [{"messages": m} for m in conversations(8, seed=11)])
    got = xorl_train(config, *args[1:], f"--data.dataset={good}", f"--data.eval_dataset={data}", "--train.eval_steps=2",
                     "--check", "--world-size=2", cwd=tmp_path)
    assert got.code == 2 and "xorl-train: " in got.err and "chat.jsonl:31: messages[1] has role 'gpt'" in got.err, \
        got.text


@pytest.mark.parametrize("kind", ["llama3", "chatml"])
def test_documents_start_as_the_tokenizer_starts_a_text(tmp_path, kind):
    """Before: text and prompt/completion rows were tokenised without the tokenizer's own leading
    <|begin_of_text|>, so a Llama 3 fine-tune trained on what inference (``tokenizer(prompt)``) never
    feeds it. Reference: transformers' tokenizer, the way TRL builds a prompt/completion row (the prompt
    with the tokenizer's special tokens, the completion without, then end-of-text)."""
    from transformers import AutoTokenizer

    from tests.support.chat_data import make_bos_tokenizer

    folder = make_bos_tokenizer(tmp_path / "tok") if kind == "llama3" else make_chat_tokenizer(tmp_path / "tok")
    hf = AutoTokenizer.from_pretrained(folder)
    eos = hf.eos_token_id
    rows = [{"prompt": "What is 3+4?", "completion": " 7"}, {"prompt": "Name a colour:", "completion": " red"}]
    ds = _dataset(write_jsonl(tmp_path / "pc.jsonl", rows), folder)
    for seq, row in zip(ds.sequences, rows):
        prompt = hf(row["prompt"])["input_ids"]
        completion = hf(row["completion"], add_special_tokens=False)["input_ids"] + [eos]
        n = len(prompt) + len(completion)
        assert seq.input_ids[:n].tolist() == prompt + completion
        assert seq.labels[:n].tolist() == [IGNORE_INDEX] * (len(prompt) - 1) + completion + [IGNORE_INDEX]
    assert (hf("x")["input_ids"][0] == hf.bos_token_id) == (kind == "llama3")  # the case is what it claims
    texts = [{"text": "the cat sat"}, {"text": hf.bos_token + "already marked" if hf.bos_token else "plain"}]
    ds = _dataset(write_jsonl(tmp_path / "text.jsonl", texts), folder)
    for seq, row in zip(ds.sequences, texts):
        ids = hf(row["text"], add_special_tokens=False)["input_ids"]
        lead = hf("a")["input_ids"][:-len(hf("a", add_special_tokens=False)["input_ids"])]
        expected = (lead if ids[:len(lead)] != lead else []) + ids + [eos]  # never two <|begin_of_text|>
        assert seq.input_ids[:len(expected)].tolist() == expected


def test_openai_text_parts_are_joined_and_other_contents_refused(tmp_path, chat_tokenizer):
    """OpenAI's content as a list of text parts trains as the joined text (before: a template writing
    {{ content }} rendered the list's Python repr, "[{'type': 'text', ...}]", and trained on it);
    a null reply without tool_calls, a number or an image part is refused naming the message."""
    chats = conversations(3, seed=7)
    parts = [[{**m, "content": [{"type": "text", "text": m["content"][:2]}, {"type": "text", "text": m["content"][2:]}]}
              for m in chat] for chat in chats]
    as_parts = _dataset(write_jsonl(tmp_path / "parts.jsonl", [{"messages": m} for m in parts]), chat_tokenizer)
    encode, special = reference_encoder()
    for seq, chat in zip(as_parts.sequences, chats):
        ids = []
        for m in chat:  # ChatML by the test's own byte rule, from the joined strings
            ids += [special["<|im_start|>"]] + encode(f"{m['role']}\n{m['content']}") + [special["<|im_end|>"]] \
                + encode("\n")
        assert seq.input_ids[:len(ids)].tolist() == ids
        reply = encode(chat[1]["content"]) + [special["<|im_end|>"]] + encode("\n")
        assert seq.labels[seq.labels != IGNORE_INDEX].tolist() == reply
    image = [{"type": "image_url", "image_url": {"url": "x.png"}}]
    for content, says in ((None, "'content' is null"), (4, "'content' is number"),
                          (image, "'content' holds \\['image_url'\\] parts")):
        bad = [list(chat) for chat in chats]
        bad[2][1] = {"role": "assistant", "content": content}
        path = write_jsonl(tmp_path / "bad.jsonl", [{"messages": m} for m in bad])
        with pytest.raises(DataError, match=rf"bad.jsonl:3: messages\[1\]: {says}"):
            _dataset(path, chat_tokenizer)


def test_a_template_that_rewrites_earlier_turns_trains_each_reply_as_its_generation_marks_say(tmp_path):
    """Qwen3's template (past reasoning dropped, a think block on the last reply) does not render
    turn by turn; multi-turn rows were refused. The replies are now located in the whole rendering:
    the trained tokens equal transformers' assistant mask of the same template with {% generation %}
    marks around each reply (the same text), on multi-turn rows with a system prompt and reasoning."""
    from tests.support.chat_data import QWEN3, QWEN3_GENERATION

    chats = conversations(4, seed=8, turns=3)
    chats[0] = [{"role": "system", "content": "be brief"}] + chats[0]
    chats[1][-1] = {**chats[1][-1], "reasoning_content": "add the units first"}
    chats[2][1] = {**chats[2][1], "reasoning_content": "an earlier turn's thought"}
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in chats])
    plain = _dataset(path, make_chat_tokenizer(tmp_path / "plain", QWEN3))
    marked = _dataset(path, make_chat_tokenizer(tmp_path / "marked", QWEN3_GENERATION))
    assert not plain.encoder._chat.has_generation_marks and marked.encoder._chat.has_generation_marks
    for ours, reference in zip(plain.sequences, marked.sequences):
        assert ours.input_ids.tolist() == reference.input_ids.tolist()
        assert ours.labels.tolist() == reference.labels.tolist()
    renderer = plain.encoder._chat
    for chat in chats:  # each row is the case that was refused: up to its first reply is no prefix
        first = next(i for i, m in enumerate(chat) if m["role"] == "assistant")
        assert not renderer._render(chat).startswith(renderer._render(chat[:first + 1]))


@pytest.mark.parametrize("train_on", ["assistant", "all"])
def test_trl_conversational_prompt_completion_trains_on_the_completion(tmp_path, chat_tokenizer, train_on):
    """TRL's conversational prompt/completion rows ('prompt' and 'completion' lists of messages; refused
    before: "'prompt' is list, expected a string"). Reference: transformers' apply_chat_template the way
    TRL builds the row: ids of prompt + completion, the loss after the prompt's generation prompt."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(chat_tokenizer)
    chats = conversations(3, seed=9, turns=2)
    system = [{"role": "system", "content": "be brief"}]
    rows = [{"prompt": system + chat[:3], "completion": chat[3:]} for chat in chats]
    ds = _dataset(write_jsonl(tmp_path / "pc.jsonl", rows), chat_tokenizer, train_on=train_on)
    assert ds.encoder.format == "prompt_completion"
    for seq, row in zip(ds.sequences, rows):
        full = hf.apply_chat_template(row["prompt"] + row["completion"], tokenize=True, return_dict=True)["input_ids"]
        prompt = hf.apply_chat_template(row["prompt"], tokenize=True, add_generation_prompt=True,
                                        return_dict=True)["input_ids"]
        assert full[:len(prompt)] == prompt
        labels = full if train_on == "all" else [IGNORE_INDEX] * len(prompt) + full[len(prompt):]
        assert seq.input_ids[:len(full)].tolist() == full
        assert seq.labels[:len(full)].tolist() == labels[1:] + [IGNORE_INDEX]
    bad = [{"prompt": [{"role": "human", "content": "hi"}], "completion": [{"role": "assistant", "content": "yo"}]}]
    with pytest.raises(DataError, match=r"bad.jsonl:1: prompt\[0\] has role 'human'.*rename it to 'user'"):
        _dataset(write_jsonl(tmp_path / "bad.jsonl", bad), chat_tokenizer)


def test_a_dataset_dicts_rows_are_named_with_the_split_read(tmp_path, chat_tokenizer):
    """One save_to_disk DatasetDict as data.dataset (train) and data.eval_dataset (validation): the log
    and errors named both "folder row 0"; they name the split read, the defaulted one too."""
    datasets = pytest.importorskip("datasets")
    rows = [{"messages": m} for m in conversations(6, seed=10)]
    folder = str(tmp_path / "dd")
    datasets.DatasetDict(train=datasets.Dataset.from_list(rows[:4]),
                         validation=datasets.Dataset.from_list(rows[4:])).save_to_disk(folder)
    config = DataConfig(dataset=folder, eval_dataset=folder, tokenizer=chat_tokenizer, seq_len=128)
    train, evaluation = PackedDataset(config), PackedDataset(config, part="eval")
    assert f"{folder}[train] row 0" in train.report()[0] and "from 4 rows" in train.report()[0]
    assert f"{folder}[validation] row 0" in evaluation.report()[0] and "from 2 rows" in evaluation.report()[0]
