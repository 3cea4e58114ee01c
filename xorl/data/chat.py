"""Chat rows rendered with the model folder's chat template, and which tokens are the assistant's.

The template is the tokenizer's (tokenizer_config.json ``chat_template`` or chat_template.jinja),
rendered by transformers' ``apply_chat_template``. The assistant tokens (the ones trained on with
``data.train_on: assistant``) come from one of two ways:

- the template marks them with ``{% generation %}`` … ``{% endgeneration %}``: transformers returns
  the mask (``return_assistant_tokens_mask``), the way TRL's ``assistant_only_loss`` does;
- otherwise the conversation is rendered incrementally: assistant turn i spans the characters
  between ``render(messages[:i], add_generation_prompt=True)`` and ``render(messages[:i + 1])``
  (the prompt of a turn is not the assistant's; its reply and end-of-turn token are). This holds
  when each rendering is a prefix of the next, which is checked. A template that rewrites earlier
  turns (Qwen3's drops past reasoning) has each reply located in the whole rendering instead
  (``_located``: the same span where both work); a row where neither can be checked is refused
  with the fix named. The full
  text is tokenised once and a token is the assistant's when its first character lies in a span,
  so the tokens are exactly those of the full rendering.
"""

from __future__ import annotations

import re

from xorl.data.corpus import DataError, _json_kind

_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
_MARK = "\ue000xorl reply\ue001"  # private-use characters around it: in no dataset's text


# The roles of OpenAI's chat format and of the templates that extend it (tool results, Llama 3.1's
# ipython). Any other role is refused: a template renders it like any turn, but it is never the
# assistant's, so a reply under another name ("gpt", "bot", "Assistant") would silently train on nothing.
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer", "function", "ipython")
# Other datasets' spellings (ShareGPT's "from" values, ...) and the role they mean.
_ROLE_ALIASES = {"human": "user", "gpt": "assistant", "bot": "assistant", "model": "assistant",
                 "chatgpt": "assistant", "observation": "tool"}


def check_messages(messages, where, key: str = "messages") -> list[dict]:
    """``messages`` must be a non-empty list of {role: one of CHAT_ROLES, content: ...} objects; returns
    them with each content a string (``_plain_content``)."""
    if not isinstance(messages, list):
        raise DataError(f"{where}: {key!r} must be a non-empty list of {{'role', 'content'}} objects, "
                        f"got {type(messages).__name__}")
    if not messages:
        raise DataError(f"{where}: {key!r} is an empty conversation; remove the row or give it its "
                        "{'role', 'content'} turns")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or "content" not in message:
            raise DataError(f"{where}: {key}[{i}] must be an object with a string 'role' and a 'content'")
        role = message["role"]
        if role not in CHAT_ROLES:
            meant = _ROLE_ALIASES.get(role.strip().lower(), role.strip().lower())
            fix = f"rename it to {meant!r}" if meant in CHAT_ROLES else "rename it to one of them"
            raise DataError(f"{where}: {key}[{i}] has role {role!r}, not a chat role {list(CHAT_ROLES)}; {fix} "
                            "(only 'assistant' turns are trained on with data.train_on: assistant)")
    return [_plain_content(message, f"{where}: {key}[{i}]") for i, message in enumerate(messages)]


def _plain_content(message: dict, where: str) -> dict:
    """The message with its content as the template expects: a string. OpenAI's list of text parts
    ([{"type": "text", "text": ...}]) is joined, as the API reads it; without this a template writing
    ``{{ content }}`` renders the list's Python repr and trains on it. ``null`` is kept only beside
    ``tool_calls`` (the template renders the calls); anything else is refused, naming the message."""
    content = message["content"]
    if isinstance(content, str) or (content is None and message.get("tool_calls")):
        return message
    if isinstance(content, list) and content and all(isinstance(p, dict) for p in content):
        kinds = sorted({str(p.get("type")) for p in content if p.get("type") != "text"})
        if not kinds and all(isinstance(p.get("text"), str) for p in content):
            return {**message, "content": "".join(p["text"] for p in content)}
        if kinds:
            raise DataError(f"{where}: 'content' holds {kinds} parts; xorl trains on text: keep the "
                            "{'type': 'text', 'text': ...} parts only")
    raise DataError(f"{where}: 'content' is {_json_kind(content)}; give a string (or a list of "
                    "{'type': 'text', 'text': str} parts; null only beside 'tool_calls')")


class ChatRenderer:
    """Renders ``messages`` rows to (token ids, assistant mask) with a transformers tokenizer."""

    def __init__(self, hf_tokenizer, tokenizer_name: str):
        template = getattr(hf_tokenizer, "chat_template", None) if hf_tokenizer is not None else None
        if not template:
            raise DataError(
                f"data.format messages needs a chat template, and data.tokenizer={tokenizer_name!r} has none "
                "(tokenizer_config.json 'chat_template' or chat_template.jinja); use a model folder that ships "
                "one, or render the rows to 'text' / 'prompt' + 'completion'")
        self.hf = hf_tokenizer
        self.template = template if isinstance(template, str) else None
        self.has_generation_marks = bool(self.template and _GENERATION.search(self.template))

    def _render(self, messages, add_generation_prompt: bool = False) -> str:
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def encode(self, messages, where, assistant_only: bool) -> tuple[list[int], list[bool] | None]:
        """(ids, mask): mask[i] says token i is the assistant's; None when every token trains."""
        try:
            if not assistant_only:
                return self._tokenize(self._render(messages))[0], None
            if self.has_generation_marks:
                out = self.hf.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                  return_assistant_tokens_mask=True)
                return list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]
            return self._incremental(messages, where)
        except DataError:
            raise
        except Exception as e:  # noqa: BLE001 - the template's own error (jinja2, a missing key), named
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise DataError(f"{where}: the chat template cannot render this row: {first}") from None

    def encode_completion(self, prompt, completion, where, assistant_only: bool) -> tuple[list[int], list[bool] | None]:
        """TRL's conversational prompt/completion (both lists of messages): the conversation prompt +
        completion, trained (``assistant_only``) from the end of the prompt's generation prompt to the end,
        as TRL's completion mask; the rendering of the prompt must be a prefix of the whole (checked)."""
        messages = prompt + completion
        try:
            full = self._render(messages)
            if not assistant_only:
                return self._tokenize(full)[0], None
            start = self._render(prompt, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - the template's own error, named
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise DataError(f"{where}: the chat template cannot render this row: {first}") from None
        if not full.startswith(start):
            raise DataError(f"{where}: the chat template does not render the 'prompt' messages (with the generation "
                            "prompt) as a prefix of 'prompt' + 'completion', so the completion's tokens cannot be told "
                            "apart; write the row as 'messages', or set data.train_on: all")
        ids, offsets = self._tokenize(full)
        return ids, [first >= len(start) for first, _ in offsets]

    def _tokenize(self, text: str):
        out = self.hf(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(out["input_ids"]), out["offset_mapping"]

    def _empty_prompt(self) -> str:
        """The generation prompt of an empty conversation (a reply that comes first); '' where the
        template cannot render one."""
        try:
            return self._render([], add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - many templates index messages[0]
            return ""

    def _located(self, messages, i, full: str, after: int) -> tuple[int, int] | None:
        """Assistant turn i's characters in ``full`` for a template that rewrites earlier turns (Qwen3's
        drops past reasoning and puts an empty think block on the last reply only, so a prefix of the
        conversation is not rendered as a prefix of the whole). The reply's content is where a marker
        put in its place lands, everything else rendering the same (checked); the span runs from the end
        of the turn's generation prompt (its last occurrence after the previous reply, before the
        content) to the end of the turn (what follows the content when the reply is the last message):
        the same span the turn-by-turn rendering gives where that works. None when a check fails."""
        marked = {**messages[i], "content": _MARK}
        before, found, rest = self._render([*messages[:i], marked, *messages[i + 1:]]).partition(_MARK)
        if not found or _MARK in rest or not (full.startswith(before) and full.endswith(rest)) \
                or len(before) + len(rest) > len(full):
            return None
        content_start, content_end = len(before), len(full) - len(rest)
        if not i:
            return None
        base, prompt = self._render(messages[:i]), self._render(messages[:i], add_generation_prompt=True)
        cue = prompt[len(base):] if prompt.startswith(base) else ""
        at = full.rfind(cue, after, content_start) if cue else -1
        tail = self._render([*messages[:i], marked]).partition(_MARK)[2]
        if at < 0 or not tail or not full.startswith(tail, content_end):
            return None
        return at + len(cue), content_end + len(tail)

    def _incremental(self, messages, where) -> tuple[list[int], list[bool]]:
        full = self._render(messages)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            start = self._render(messages[:i], add_generation_prompt=True) if i else self._empty_prompt()
            end = self._render(messages[: i + 1])
            if full.startswith(end) and end.startswith(start):
                spans.append((len(start), len(end)))
                continue
            span = self._located(messages, i, full, spans[-1][1] if spans else 0)
            if span is None:
                raise DataError(
                    f"{where}: the chat template does not render this conversation turn by turn (rendering the "
                    f"first {i + 1} messages is not a prefix of the whole) and messages[{i}]'s reply cannot be "
                    "located in the whole either, so the assistant tokens cannot be told apart; mark them with "
                    "{% generation %} ... {% endgeneration %} in the template, or set data.train_on: all")
            spans.append(span)
        ids, offsets = self._tokenize(full)
        mask = [any(a <= first < b for a, b in spans) for first, _ in offsets]
        return ids, mask
