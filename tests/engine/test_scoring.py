"""`sonar.engine.scoring`: text pairs, how a model scores them, a cross-encoder's pair tokens, the
cosine path; and through the library (`sonar.open`) on the embedded model as an embedding model."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

import sonar
from sonar.engine.scoring import cosine, pair_tokens, pair_up, score, scoring_kind
from sonar.errors import InvalidRequestError
from sonar.pooling_params import PoolingInfo


def test_pairs_are_one_against_each_or_n_against_n():
    assert pair_up("q", ["a", "b"]) == [("q", "a"), ("q", "b")]
    assert pair_up(["q"], "a") == [("q", "a")]
    assert pair_up(["q", "r"], ["a", "b"]) == [("q", "a"), ("r", "b")]
    for queries, documents, param in [(["q", "r"], ["a"], "documents"), ([], ["a"], "queries"), ("q", [], "documents")]:
        with pytest.raises(InvalidRequestError) as info:
            pair_up(queries, documents)
        assert info.value.param == param


def test_how_a_model_scores():
    assert scoring_kind(PoolingInfo(tasks=["classify"], pooling_type="cls", hidden_size=8, num_labels=1)) == (
        "cross-encoder"
    )
    assert scoring_kind(PoolingInfo(tasks=["embed", "token_embed"], pooling_type="last", hidden_size=8)) == "embedding"
    # A classifier with one label that also embeds is a cross-encoder first.
    both = PoolingInfo(tasks=["embed", "classify"], pooling_type="cls", hidden_size=8, num_labels=1)
    assert scoring_kind(both) == "cross-encoder"
    for info, words in [
        (None, "--runner pooling"),
        (PoolingInfo(tasks=["classify"], pooling_type="cls", hidden_size=8, num_labels=3), "one label"),
    ]:
        with pytest.raises(InvalidRequestError) as exc:
            scoring_kind(info)
        assert words in str(exc.value) and exc.value.param == "model"


def test_cosine():
    assert cosine([1, 0], [0, 1]) == 0.0
    assert cosine([1, 2], [2, 4]) == pytest.approx(1.0)
    assert cosine([1, 1], [-1, -1]) == pytest.approx(-1.0)
    assert cosine([0, 0], [1, 1]) == 0.0
    assert cosine([3, 4], [4, 3]) == pytest.approx(24 / 25)


@pytest.fixture(scope="module")
def bert_tokenizer():
    from transformers import BertTokenizerFast

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "what", "is", "a", "cat", "small", "feline", "tree", "?"]
    return BertTokenizerFast(vocab={w: i for i, w in enumerate(words)})


def test_a_pair_is_tokenized_as_the_tokenizer_joins_pairs(bert_tokenizer):
    ids, start = pair_tokens(bert_tokenizer, "what is a cat ?", "a small feline", None)
    assert bert_tokenizer.convert_ids_to_tokens(ids) == [
        *("[CLS]", "what", "is", "a", "cat", "?", "[SEP]"),
        *("a", "small", "feline", "[SEP]"),
    ]
    assert start == 7  # the document's first token: where token type 1 begins
    cut, start = pair_tokens(bert_tokenizer, "what is a cat ?", "a small feline", 8)
    assert len(cut) == 8 and start is not None and start < 8


def test_without_token_types_there_is_no_pair_start():
    class NoTypes:
        def __call__(self, text: str, text_pair: str, **kwargs: object) -> dict:
            return {"input_ids": [1, 2, 3]}

    assert pair_tokens(NoTypes(), "q", "d", None) == ([1, 2, 3], None)


def test_cosine_of_a_vector_with_itself_is_one():
    v = [math.sin(i) for i in range(64)]
    assert cosine(v, v) == pytest.approx(1.0)


# -- through the library --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
async def embedder(one_thread, tiny_engine_checkpoints):
    """The tiny Qwen3 served as an embedding model (last token, normalized)."""
    path = tiny_engine_checkpoints["qwen3"].path
    async with sonar.open(
        str(path), dtype="float32", runner="pooling", num_gpu_blocks_override=64, max_model_len=16
    ) as llm:
        yield llm


TEXTS = ["w5 w9 w13 w2", "w1 w2 w3", "w300 w7", "w42"]


@pytest.mark.anyio
async def test_an_embedding_model_scores_by_cosine(embedder):
    vectors = {t: (await embedder.embed(t)).data.tolist() for t in TEXTS}
    results = await score(embedder, TEXTS[0], TEXTS[1:])
    assert [r.index for r in results] == [0, 1, 2]
    assert [r.score for r in results] == pytest.approx(
        [cosine(vectors[TEXTS[0]], vectors[d]) for d in TEXTS[1:]], abs=1e-5
    )
    lengths = {t: len(t.split()) for t in TEXTS}
    # The query counts once, with the first pair.
    assert [r.prompt_tokens for r in results] == [
        lengths[TEXTS[0]] + lengths[TEXTS[1]],
        lengths[TEXTS[2]],
        lengths[TEXTS[3]],
    ]
    pairs = await score(embedder, [TEXTS[0], TEXTS[2]], [TEXTS[0], TEXTS[3]])
    assert pairs[0].score == pytest.approx(1.0, abs=1e-5)
    assert pairs[1].score == pytest.approx(cosine(vectors[TEXTS[2]], vectors[TEXTS[3]]), abs=1e-5)


@pytest.mark.anyio
async def test_too_long_is_refused_unless_truncated(embedder):
    long = " ".join(f"w{i}" for i in range(1, 30))
    with pytest.raises(InvalidRequestError) as info:
        await score(embedder, long, [TEXTS[1]])
    assert info.value.code == "context_length_exceeded"
    results = await score(embedder, long, [TEXTS[1]], truncate_prompt_tokens=-1)
    assert results[0].prompt_tokens == 16 + 3
    with pytest.raises(InvalidRequestError) as info:
        await score(embedder, TEXTS[0], [TEXTS[1]], use_activation=False)
    assert info.value.param == "use_activation"


@pytest.mark.anyio
async def test_a_generative_model_cannot_score(one_thread, tiny_engine_checkpoints):
    path = tiny_engine_checkpoints["qwen3"].path
    async with sonar.open(str(path), dtype="float32", num_gpu_blocks_override=16, max_model_len=16) as llm:
        with pytest.raises(InvalidRequestError, match="--runner pooling"):
            await score(llm, "w1", ["w2"])


# -- cross-encoders (tests/models/tiny_pooling.py) ------------------------------------------------
QUERY = "what is the capital of france"
DOCUMENTS = ["paris is the capital of france", "the cat sat on the mat", "gravity is a force", "paris"]


@pytest.fixture(scope="module")
def cross_encoders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Rerankers with one label: a tiny BertForSequenceClassification (token types: the pair's
    second text is type 1), XLMRobertaForSequenceClassification (none) and
    Qwen3ForSequenceClassification (a decoder)."""
    from tests.models.tiny_pooling import save_tiny_bert, save_tiny_decoder_classifier

    out = {}
    for i, kind in enumerate(("bert", "xlm-roberta")):
        path = tmp_path_factory.mktemp(f"ce-{kind}")
        save_tiny_bert(path, kind, num_labels=1, seed=10 + i)
        out[kind] = path
    out["qwen3"] = tmp_path_factory.mktemp("ce-qwen3")
    save_tiny_decoder_classifier(out["qwen3"], "qwen3", num_labels=1, seed=12)
    return out


def cross_encoder_scores(path: Path, pairs: list[tuple[str, str]]) -> list[float]:
    from sentence_transformers import CrossEncoder

    return [float(s) for s in CrossEncoder(str(path), device="cpu").predict(pairs)]


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["bert", "xlm-roberta", "qwen3"])
async def test_a_cross_encoder_scores_as_sentence_transformers(one_thread, cross_encoders, kind: str):
    path = cross_encoders[kind]
    expected = cross_encoder_scores(path, [(QUERY, d) for d in DOCUMENTS])
    async with sonar.open(str(path), dtype="float32", runner="pooling", num_gpu_blocks_override=64) as llm:
        assert scoring_kind(llm.info.pooling) == "cross-encoder"
        results = await score(llm, QUERY, DOCUMENTS)
        pairs = await score(llm, [QUERY, DOCUMENTS[1]], [DOCUMENTS[0], DOCUMENTS[2]])
        logits = await score(llm, QUERY, DOCUMENTS[:1], use_activation=False)
        long = " ".join(["the cat sat on the mat"] * 30)
        with pytest.raises(InvalidRequestError) as info:
            await score(llm, QUERY, [long])
        cut = await score(llm, QUERY, [long], truncate_prompt_tokens=-1)
    assert [r.score for r in results] == pytest.approx(expected, abs=1e-4)
    assert pairs[0].score == pytest.approx(expected[0], abs=1e-4)
    assert pairs[1].score == pytest.approx(cross_encoder_scores(path, [(DOCUMENTS[1], DOCUMENTS[2])])[0], abs=1e-4)
    assert 1 / (1 + math.exp(-logits[0].score)) == pytest.approx(expected[0], abs=1e-4)
    assert info.value.code == "context_length_exceeded"
    assert cut[0].prompt_tokens == llm.info.max_model_len
