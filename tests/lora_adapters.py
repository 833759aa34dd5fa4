"""Random LoRA adapters made by PEFT for the tiny models of `hf_models`, and their references:
PEFT's merged model, and llama.cpp's GGUF adapter layout of the same adapter."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import torch

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
# name -> (rank, target modules, rslora): ranks 4 and 16, different layers, one with rslora
ADAPTERS = {
    "qv4": (4, ["q_proj", "v_proj"], False),
    "all16": (16, ATTENTION + MLP, True),
    "mlp8": (8, ["o_proj", "gate_proj", "down_proj"], False),
}


def make_adapter(base, directory: Path, rank: int, targets: list[str], rslora: bool, seed: int):
    """Save a PEFT adapter of random A and B (B is zeros at PEFT's init: drawn here) over a copy of
    `base` -> the PEFT model (unmerged)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, use_rslora=rslora, lora_dropout=0.0,
                        init_lora_weights=False)
    model = get_peft_model(copy.deepcopy(base), config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.3)
    model.save_pretrained(directory)
    return model.eval()


def merged(peft_model):
    """The base model with the adapter added into its weights (PEFT's merge)."""
    return copy.deepcopy(peft_model).merge_and_unload().eval()


def write_gguf_adapter(peft_model, path: Path, heads: tuple[int, int], alpha: float) -> Path:
    """The adapter as llama.cpp's convert_lora_to_gguf.py writes a Llama one: tensors
    blk.N.<layer>.weight.lora_a [r, in] and .lora_b [out, r] (q's and k's B rows interleaved by head,
    llama.cpp's rope layout), general.type "adapter", adapter.type "lora", adapter.lora.alpha."""
    import gguf

    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", alpha)
    for name, p in peft_model.named_parameters():
        if "lora_" not in name:
            continue
        layer, module = int(name.split(".layers.")[1].split(".")[0]), name.split(".lora_")[0].rsplit(".", 1)[1]
        value = p.detach().numpy().astype(np.float32)
        half = "a" if ".lora_A." in name else "b"
        if half == "b" and module in ("q_proj", "k_proj"):
            n = heads[0] if module == "q_proj" else heads[1]
            value = value.reshape(n, 2, value.shape[0] // n // 2, -1).swapaxes(1, 2).reshape(value.shape)
        writer.add_tensor(f"blk.{layer}.{names[module]}.weight.lora_{half}", np.ascontiguousarray(value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
