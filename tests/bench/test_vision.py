"""`sonar.bench.vision`'s dummy server checkpoint: its tokenizer puts the vision tokens at the
ids the config names, so the server expands the image placeholder the bench's chat renders."""

from __future__ import annotations

import json

from sonar.bench.vision import IMAGE_PAD, dummy_checkpoint


def test_dummy_checkpoint_tokenizer_has_the_configs_vision_ids() -> None:
    from transformers import AutoTokenizer

    from sonar.models.qwen2_vl import IMAGE_TEXT

    folder = dummy_checkpoint(2, tokenizer=True)
    config = json.loads((folder / "config.json").read_text())
    assert config["text_config"]["num_hidden_layers"] == 2
    tok = AutoTokenizer.from_pretrained(str(folder))
    assert len(tok) == config["text_config"]["vocab_size"]
    chat = [{"role": "user", "content": f"{IMAGE_TEXT} w7 w8"}]
    ids = tok(tok.apply_chat_template(chat, tokenize=False), add_special_tokens=False).input_ids
    assert ids == [1, config["vision_start_token_id"], IMAGE_PAD, config["vision_end_token_id"], 7, 8, 2, 4]
