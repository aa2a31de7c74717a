"""IncrementalDetokenizer: streaming equals a full decode, no broken characters, stop strings."""

from __future__ import annotations

import pytest

from sonar.core.detokenize import IncrementalDetokenizer
from sonar.sampling_params import SamplingParams

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Emoji: 😀🎉 family 👨‍👩‍👧 flags 🇯🇵🇫🇷 and skin tones 👍🏽 done",
    "CJK: 世界你好，こんにちは、안녕하세요。漢字テスト",
    "Mixed naïve café — “quotes” ∑∫√ 🤖 code: def f(x): return x**2\n\ttabs",
]


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    """Feed `ids` `chunk` at a time, the last call marked final; return the deltas."""
    deltas = []
    for i in range(0, len(ids), chunk):
        last = i + chunk >= len(ids)
        deltas.append(detok.update(ids[i : i + chunk], final=last).text)
        if detok.finished:
            break
    return deltas


def ids_for(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_streaming_equals_full_decode(embedded_tokenizer, text: str, chunk: int) -> None:
    ids = ids_for(embedded_tokenizer, text)
    detok = IncrementalDetokenizer(embedded_tokenizer)
    deltas = stream(detok, ids, chunk)
    assert "".join(deltas) == embedded_tokenizer.decode(ids) == text
    assert detok.output_text == text
    assert all("\ufffd" not in d for d in deltas)


def test_multibyte_characters_are_held_until_complete(embedded_tokenizer) -> None:
    text = "😀世界👨‍👩‍👧"
    ids = ids_for(embedded_tokenizer, text)
    assert len(ids) > len(text)  # several characters really are split over tokens
    detok = IncrementalDetokenizer(embedded_tokenizer)
    deltas = [detok.update([i]).text for i in ids]
    assert "" in deltas
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text


def test_prompt_context_does_not_change_byte_level_text(embedded_tokenizer) -> None:
    chat = "<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n"
    prompt = ids_for(embedded_tokenizer, chat)
    ids = ids_for(embedded_tokenizer, " Hi there 👋")
    detok = IncrementalDetokenizer(embedded_tokenizer, prompt_token_ids=prompt)
    assert "".join(stream(detok, ids)) == embedded_tokenizer.decode(ids)


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(embedded_tokenizer, skip: bool) -> None:
    ids = ids_for(embedded_tokenizer, "<|im_start|>assistant\nHello 世界<|im_end|>")
    assert embedded_tokenizer.convert_tokens_to_ids("<|im_start|>") in ids
    detok = IncrementalDetokenizer(embedded_tokenizer, skip_special_tokens=skip)
    text = "".join(stream(detok, ids))
    assert text == embedded_tokenizer.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in text) is not skip


def spans_token_boundary(tokenizer, ids: list[int], text: str, needle: str) -> bool:
    """Whether `needle` (at its first place in `text`) starts and ends in different tokens."""
    start = text.index(needle)
    end = start + len(needle)
    pos = 0
    for i in range(len(ids)):
        pos = len(tokenizer.decode(ids[: i + 1]))
        if pos > start:
            return pos < end
    return False


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize(
    "text, stop",
    [
        ("The answer is forty-two. Anything else? No.", "two. Any"),
        ("Result: 世界和平 then more text", "界和"),
        ("Ends with an emoji 🎉🎉 and more", "🎉 and"),
        ("Code:\n```python\nprint(1)\n```\nDone", "```\nDone"),
    ],
)
def test_stop_string_across_tokens(embedded_tokenizer, text: str, stop: str, include: bool) -> None:
    ids = ids_for(embedded_tokenizer, text)
    assert spans_token_boundary(embedded_tokenizer, ids, text, stop)
    params = SamplingParams(stop=["never-there", stop], include_stop_str_in_output=include)
    detok = IncrementalDetokenizer.from_params(embedded_tokenizer, params)
    deltas = []
    for i in ids:
        update = detok.update([i])
        deltas.append(update.text)
        if update.stopped:
            break
    cut = text.index(stop) + (len(stop) if include else 0)
    assert "".join(deltas) == text[:cut] == detok.output_text
    assert update.stop_str == stop and detok.stop_str == stop and detok.finished
    assert all("\ufffd" not in d for d in deltas)
    assert detok.update(ids[-1:]).text == ""


def test_stop_prefix_is_held_back_then_released(embedded_tokenizer) -> None:
    text = "We say STO but never finish it, then STOP."
    ids = ids_for(embedded_tokenizer, text)
    detok = IncrementalDetokenizer(embedded_tokenizer, stop=["STOP!"])
    sent = ""
    held_something = False
    for n, i in enumerate(ids[:-1], start=1):
        sent += detok.update([i]).text
        decoded = embedded_tokenizer.decode(ids[:n])
        # Nothing that could still become "STOP!" has been sent, and nothing else is held.
        held = decoded[len(sent) :]
        assert decoded.startswith(sent)
        assert held == "" or "STOP!".startswith(held)
        held_something |= held.startswith("S")
    assert held_something
    last = detok.update(ids[-1:], final=True)
    assert sent + last.text == text and not last.stopped


def test_stop_found_inside_a_multi_token_update(embedded_tokenizer) -> None:
    """A multi-step decode's tokens come several at once: the output keeps those up to the one
    that completed the stop string, as one at a time would."""
    text = "alpha beta gamma delta epsilon"
    ids = ids_for(embedded_tokenizer, text)
    detok = IncrementalDetokenizer(embedded_tokenizer, stop=["gamma", "beta"])
    update = detok.update(ids)
    assert update.text == "alpha " and update.stop_str == "beta"
    completes = next(i for i in range(len(ids)) if "beta" in embedded_tokenizer.decode(ids[: i + 1]))
    assert update.kept == completes + 1 < len(ids)
    assert detok.num_output_tokens == update.kept
    plain = IncrementalDetokenizer(embedded_tokenizer).update(ids, final=True)  # no stop strings: all kept
    assert plain.text == text and plain.kept is None


def test_earliest_stop_wins_and_text_after_is_dropped(embedded_tokenizer) -> None:
    text = "one two three"
    ids = ids_for(embedded_tokenizer, text)
    detok = IncrementalDetokenizer(embedded_tokenizer, stop=["three", "two"], include_stop_str_in_output=True)
    assert "".join(stream(detok, ids, chunk=len(ids))) == "one two"


def test_min_tokens_delays_stop_strings(embedded_tokenizer) -> None:
    text = "stop here, and stop there"
    ids = ids_for(embedded_tokenizer, text)
    first_stop_token = next(i for i in range(len(ids)) if "stop" in embedded_tokenizer.decode(ids[: i + 1]))
    detok = IncrementalDetokenizer(embedded_tokenizer, stop=["stop"], min_tokens=first_stop_token + 1)
    out = "".join(stream(detok, ids))
    assert out == "stop here, and " and detok.stop_str == "stop"


def test_final_stop_token_text_is_left_out(embedded_tokenizer) -> None:
    eos = embedded_tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = ids_for(embedded_tokenizer, "Hi!") + [eos]
    for include, expected in [(False, "Hi!"), (True, "Hi!<|im_end|>")]:
        detok = IncrementalDetokenizer(
            embedded_tokenizer, skip_special_tokens=False, include_stop_str_in_output=include
        )
        for i in ids[:-1]:
            detok.update([i])
        update = detok.update(ids[-1:], stop_token=True)
        assert detok.output_text == expected and detok.finished and not update.stopped


def test_final_drops_an_incomplete_character(embedded_tokenizer) -> None:
    ids = ids_for(embedded_tokenizer, "ok 😀")
    detok = IncrementalDetokenizer(embedded_tokenizer)
    text = "".join(stream(detok, ids[:-1]))
    assert text == "ok" and "\ufffd" not in text


def test_byte_fallback_tokenizer(byte_fallback_tokenizer) -> None:
    tok = byte_fallback_tokenizer
    text = "Hello world 😀 世界! the end"
    ids = tok.encode(text).ids
    assert tok.token_to_id("<0xF0>") in ids
    detok = IncrementalDetokenizer(tok)
    deltas = stream(detok, ids)
    assert "".join(deltas) == tok.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)


def test_byte_fallback_prompt_context_keeps_leading_space(byte_fallback_tokenizer) -> None:
    tok = byte_fallback_tokenizer
    prompt = tok.encode("the end").ids
    ids = tok.encode("Hello world").ids
    with_context = IncrementalDetokenizer(tok, prompt_token_ids=prompt)
    assert "".join(stream(with_context, ids)) == " Hello world"
    alone = IncrementalDetokenizer(tok)
    assert "".join(stream(alone, ids)) == "Hello world"


def test_byte_fallback_stop_inside_multibyte_run(byte_fallback_tokenizer) -> None:
    tok = byte_fallback_tokenizer
    text = "ab 世界 cd"
    ids = tok.encode(text).ids
    detok = IncrementalDetokenizer(tok, stop=["界 c"])
    deltas = stream(detok, ids)
    assert "".join(deltas) == "ab 世" and detok.stop_str == "界 c"
    assert all("\ufffd" not in d for d in deltas)


def test_random_token_sequences(embedded_tokenizer) -> None:
    """Random ids (invalid UTF-8 byte runs included): the stream is always a prefix of the full
    decode, equal to it when that ends in a complete character; a stop string cuts at its
    first occurrence."""
    import random

    rng = random.Random(0)
    vocab = len(embedded_tokenizer)
    backend = embedded_tokenizer.backend_tokenizer
    partial = [i for i in range(vocab) if "\ufffd" in backend.decode([i])]
    assert len(partial) > 100  # tokens that are pieces of multi-byte characters
    for trial in range(150):
        ids = [rng.choice(partial) if rng.random() < 0.5 else rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        full = embedded_tokenizer.decode(ids, skip_special_tokens=True)
        text = "".join(stream(IncrementalDetokenizer(embedded_tokenizer), ids))
        assert full.startswith(text)
        if not full.endswith("\ufffd"):
            assert text == full
        if len(text) > 4:
            start = rng.randrange(len(text) - 3)
            stop = text[start : start + rng.randrange(2, 4)]
            detok = IncrementalDetokenizer(embedded_tokenizer, stop=[stop])
            assert "".join(stream(detok, ids)) == text[: text.index(stop)], (trial, stop)
            assert detok.stop_str == stop
