"""``gradckpt.integrations.hf``: usable without Transformers until a model is built from a
config (the command line imports it whatever model it plans)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from gradckpt.integrations import hf

WITHOUT_TRANSFORMERS = textwrap.dedent(
    """
    import sys
    sys.modules["transformers"] = None  # import transformers now raises ImportError
    import gradckpt.integrations.hf as hf
    try:
        hf.model_from_config_json("config.json")
    except ImportError as error:
        print(error)
    """
)


def test_imports_without_transformers_and_says_how_to_install_it() -> None:
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_TRANSFORMERS], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "pip install 'gradckpt[hf]'" in result.stdout


def test_a_config_without_a_language_model_is_named_as_such(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=64).save_pretrained(tmp_path)
    with pytest.raises(hf.NoLanguageModelError, match="no causal language model for model_type"):
        hf.model_from_config_json(tmp_path / "config.json")


def test_an_encoder_decoder_config_gives_the_sequence_to_sequence_model(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    transformers.T5Config(
        vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_decoder_layers=1,
        num_heads=4, decoder_start_token_id=0, pad_token_id=0,
    ).save_pretrained(tmp_path)
    model = hf.model_from_config_json(tmp_path / "config.json")
    assert type(model).__name__ == "T5ForConditionalGeneration"
    assert model.config.use_cache is False
