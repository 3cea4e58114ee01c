"""A chat tokenizer and chat datasets built in the test (no download): a byte-level BPE with no merges
(256 byte tokens, so text tokenises segment by segment) plus ChatML's special tokens, saved as a
transformers folder whose tokenizer_config carries a Jinja chat template."""

from __future__ import annotations

import json
import random

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]

# ChatML without generation markers: the assistant spans come from incremental rendering.
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# The same rendering with {% generation %} marks around each assistant reply and its end-of-turn.
CHATML_GENERATION = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n{% generation %}"
    "{{ m['content'] }}<|im_end|>\n{% endgeneration %}{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_chat_tokenizer(folder, template: str | None = CHATML) -> str:
    """Save the tokenizer to ``folder`` (a transformers tokenizer folder); returns its path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    kwargs = {"chat_template": template} if template else {}
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                 **kwargs)
    hf.save_pretrained(str(folder))
    return str(folder)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the ByteLevel alphabet), written out independently."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def reference_encoder():
    """text -> ids by the test's own rule (one token per UTF-8 byte in make_chat_tokenizer's vocabulary),
    and the special tokens' ids (added after the 256 bytes, in order)."""
    chars = _bytes_to_unicode()
    index = {ch: i for i, ch in enumerate(sorted(chars.values()))}

    def encode(text: str) -> list[int]:
        return [index[chars[b]] for b in text.encode("utf-8")]

    return encode, {s: 256 + i for i, s in enumerate(SPECIALS)}


def conversations(n: int, seed: int, turns: int = 1) -> list[list[dict]]:
    """Arithmetic chats of ``turns`` user/assistant pairs (short: each fits a 64-token sequence for turns=1)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        messages = []
        for _ in range(turns):
            a, b = rng.randint(0, 20), rng.randint(0, 20)
            messages += [{"role": "user", "content": f"{a}+{b}?"}, {"role": "assistant", "content": f"{a + b}."}]
        out.append(messages)
    return out


def write_jsonl(path, rows: list[dict]) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


# Llama 3's layout: the tokenizer itself puts <|begin_of_text|> before a text (a post-processor), the
# chat template writes bos_token, turns end with <|eot_id|> (the end-of-text token).
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
LLAMA3 = ("{{- bos_token }}{%- for m in messages %}{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n'"
          " + m['content'] | trim + '<|eot_id|>' }}{%- endfor %}{%- if add_generation_prompt %}"
          "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")


def make_bos_tokenizer(folder) -> str:
    """A byte-level tokenizer that adds <|begin_of_text|> to every text, as Llama 3's does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(LLAMA3_SPECIALS)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", bos)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                                 chat_template=LLAMA3)
    hf.save_pretrained(str(folder))
    return str(folder)


# Qwen3's template, as it renders: past reasoning is dropped, and the replies after the last user query
# get a think block (an empty one on the last reply), so the first i + 1 messages do not render as a
# prefix of the whole. {GEN} / {ENDGEN} become the {% generation %} marks around each reply (the same
# text either way), for transformers' own assistant mask as the reference.
_QWEN3 = (
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if ns.multi_step_tool and message.role == 'user' and message.content is string %}"
    "{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}{%- set content = message.content %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{%- set reasoning_content = '' %}"
    "{%- if message.reasoning_content is string %}{%- set reasoning_content = message.reasoning_content %}{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}{GEN}"
    "{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}"
    "{{- '<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}"
    "{%- else %}{{- content }}{%- endif %}{{- '<|im_end|>\\n' }}{ENDGEN}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
QWEN3 = _QWEN3.replace("{GEN}", "").replace("{ENDGEN}", "")
QWEN3_GENERATION = _QWEN3.replace("{GEN}", "{% generation %}").replace("{ENDGEN}", "{% endgeneration %}")
