"""Makes the third-party parity fixtures under checkpoints/fixtures/ (run in its OWN environment).

    python3.11 -m venv /tmp/tvenv && /tmp/tvenv/bin/pip install torch==2.13.0 transformers==5.18.0 safetensors numpy einops
    /tmp/tvenv/bin/python checkpoints/make_parity_fixtures.py --mindspeed-dir DIR

Two tiny random models, each saved as a Hugging Face checkpoint directory (config.json +
model.safetensors written by the `safetensors` package) plus `expected.npz` (input ids, float32
logits, a prompt and the reference's greedy continuation):

* fixtures/kimi_linear/  Hugging Face transformers' own `kimi_linear` (KimiLinearForCausalLM,
  pure-torch KDA kernels, eager MLA, bf16-format experts). Checkpoint names are the released
  Kimi-Linear layout; the script re-loads the directory with transformers (its own conversion
  mapping) and checks the logits are identical before saving them.
* fixtures/k3/  Moonshot's K3 modeling code as adapted in Ascend/MindSpeed-MM
  (`mindspeed_mm/fsdp/models/kimi_k3/modeling_kimi_linear.py`; pass the folder holding that file
  as --mindspeed-dir; the file is not part of this repository). Its NPU / fla / distributed
  imports are stubbed at run time with pure-torch pieces: ShortConvolution = depthwise causal
  Conv1d + SiLU; chunk_kda = fla's gate (lower-bounded `lb * sigmoid(exp(A_log) * (g + dt_bias))`,
  or `-exp(A_log) * softplus(g + dt_bias)`), sigmoid beta, then transformers'
  `chunk_kimi_delta_attention` (pure torch). MLA runs eager with a causal mask. Routed experts
  are stored as compressed-tensors MXFP4 (weight_packed/weight_scale, random codes and scales)
  and dequantised with this script's own table for the torch model. Greedy decoding re-runs the
  full sequence each step (no cache), so it checks k3jax's cached decode against a cache-free
  reference.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import types

import numpy as np
import torch
from safetensors.torch import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
SEQ, NEW = 70, 8   # 70 > one 64-token KDA chunk, so the chunked path crosses a boundary


def randomize(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if not p.is_floating_point():
                continue
            last = name.split(".")[-1] if not name.endswith("weight") else name.split(".")[-2]
            r = torch.randn(p.shape, generator=g)
            if "A_log" in name:
                v = torch.log(torch.rand(p.shape, generator=g) * 15 + 1)
            elif "dt_bias" in name:
                v = r
            elif "e_score_correction_bias" in name:
                v = 0.05 * r
            elif "norm" in last:
                v = 1 + 0.1 * r
            elif "conv1d" in name:
                v = 0.5 * r
            elif "embed_tokens" in name:
                v = r
            elif "res_proj" in name:
                v = r * p.shape[-1] ** -0.5
            else:
                v = r * p.shape[-1] ** -0.5
            p.copy_(v.to(p.dtype))


def save_fixture(out: str, config: dict, tensors: dict, expected: dict) -> None:
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(out))
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(tmp, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    np.savez_compressed(os.path.join(tmp, "expected.npz"), **expected)
    if os.path.exists(out):
        shutil.rmtree(out)
    os.rename(tmp, out)


# --------------------------------------------------------------------------- kimi_linear
KL_CONFIG = {
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "dtype": "float32",
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 4, "hidden_act": "silu", "rms_norm_eps": 1e-5,
    "kv_lora_rank": 32, "q_lora_rank": None, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "mla_use_nope": True,
    "linear_attn_config": {"full_attn_layers": [2, 4], "kda_layers": [1, 3], "head_dim": 16, "num_heads": 4,
                           "short_conv_kernel_size": 4},
    "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 1, "moe_intermediate_size": 32,
    "moe_layer_freq": 1, "first_k_dense_replace": 1, "moe_renormalize": True, "moe_router_activation_func": "sigmoid",
    "routed_scaling_factor": 2.446, "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1,
    "num_nextn_predict_layers": 0, "tie_word_embeddings": False, "use_cache": True,
    "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
}


def kimi_linear_hub_state(model) -> dict:
    """transformers' runtime names -> the released Kimi-Linear checkpoint names (the inverse of
    its conversion mapping: split conv1d, forget_gate.*, mlp->block_sparse_moe, per-expert w1/w3/w2)."""
    cfg = model.config
    out = {}
    for name, t in model.state_dict().items():
        t = t.detach().clone()
        if ".self_attn.conv1d.weight" in name:
            for part, w in zip("qkv", torch.chunk(t, 3, dim=0)):
                out[name.replace("conv1d", f"{part}_conv1d")] = w
            continue
        name = name.replace(".forget_gate.", ".")
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        if layer is not None and cfg.mlp_layer_types[layer] == "sparse":
            name = name.replace(".mlp.", ".block_sparse_moe.")
            if name.endswith("experts.gate_up_proj"):
                w1, w3 = torch.chunk(t, 2, dim=1)
                base = name[: -len("gate_up_proj")]
                for e in range(t.shape[0]):
                    out[f"{base}{e}.w1.weight"], out[f"{base}{e}.w3.weight"] = w1[e], w3[e]
                continue
            if name.endswith("experts.down_proj"):
                base = name[: -len("down_proj")]
                for e in range(t.shape[0]):
                    out[f"{base}{e}.w2.weight"] = t[e]
                continue
        out[name] = t
    return out


def make_kimi_linear(out_root: str, seed: int) -> None:
    from transformers import AutoModelForCausalLM, KimiLinearConfig, KimiLinearForCausalLM
    config = KimiLinearConfig(**KL_CONFIG)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = KimiLinearForCausalLM(config).eval()
    randomize(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, KL_CONFIG["vocab_size"], (2, SEQ), generator=gen)
    prompt = ids[:, :12]
    with torch.no_grad():
        logits = model(ids).logits.float()
        greedy = model.generate(prompt, max_new_tokens=NEW, do_sample=False, use_cache=True,
                                eos_token_id=None, pad_token_id=0)[:, prompt.shape[1]:]
    out = os.path.join(out_root, "kimi_linear")
    save_fixture(out, KL_CONFIG, kimi_linear_hub_state(model),
                 {"input_ids": ids.numpy(), "logits": logits.numpy(), "prompt": prompt.numpy(),
                  "greedy": greedy.numpy()})
    # The saved directory must be a checkpoint transformers itself loads to the same model.
    again = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    with torch.no_grad():
        err = (again(ids).logits.float() - logits).abs().max().item()
    assert err == 0.0, f"transformers re-load of the fixture differs by {err}"
    print(f"kimi_linear: logits {tuple(logits.shape)}, greedy {greedy.tolist()}, reload max err {err}")


# ----------------------------------------------------------------------------------- K3
K3_TEXT = {
    "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"],
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 6,
    "num_attention_heads": 4, "num_key_value_heads": 4, "hidden_act": "situ",
    "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0, "rms_norm_eps": 1e-5,
    "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "mla_use_nope": True, "mla_use_output_gate": True, "attn_res_block_size": 2,
    "linear_attn_config": {"full_attn_layers": [3, 6], "kda_layers": [1, 2, 4, 5], "head_dim": 16, "num_heads": 4,
                           "short_conv_kernel_size": 4, "use_full_rank_gate": True, "gate_lower_bound": -5.0},
    "num_experts": 8, "num_experts_per_token": 3, "num_shared_experts": 2, "moe_intermediate_size": 32,
    "routed_expert_hidden_size": 32, "latent_moe_use_norm": True,
    "moe_layer_freq": 1, "first_k_dense_replace": 1, "moe_renormalize": True, "moe_router_activation_func": "sigmoid",
    "routed_scaling_factor": 1.5, "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1,
    "num_nextn_predict_layers": 0, "tie_word_embeddings": False,
    "quantization_config": {"format": "mxfp4-pack-quantized", "quant_method": "compressed-tensors",
                            "quantization_status": "compressed",
                            "config_groups": {"group_0": {"format": "mxfp4-pack-quantized", "targets": ["Linear"],
                                                          "weights": {"num_bits": 4, "type": "float",
                                                                      "group_size": 32, "strategy": "group",
                                                                      "symmetric": True, "scale_dtype": "torch.uint8"}}},
                            "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*",
                                       "re:.*mlp\\.(gate|up|gate_up|down)_proj.*", "re:.*lm_head.*",
                                       "re:.*vision_tower.*", "re:.*mm_projector.*"]},
}
K3_CONFIG = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
             "tie_word_embeddings": False, "text_config": K3_TEXT,
             "vision_config": {"patch_size": 14, "vt_hidden_size": 16}}
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def mxfp4_dequant(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """compressed-tensors mxfp4-pack-quantized: low nibble = even column; E8M0 scale per 32 inputs."""
    codes = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
    vals = E2M1[codes] * np.repeat(2.0 ** (scale.astype(np.float64) - 127), 32, axis=1)
    return vals.astype(np.float32)


def install_stubs(mindspeed_dir: str):
    """A package `msk3` around the MindSpeed-MM file, with pure-torch stand-ins for its imports."""
    import torch.nn.functional as F
    from transformers import PretrainedConfig
    from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention

    for mod in ("mindspeed_mm", "mindspeed_mm.fsdp", "mindspeed_mm.fsdp.utils", "fla", "fla.ops", "fla.modules"):
        sys.modules[mod] = types.ModuleType(mod)
    dev = types.ModuleType("mindspeed_mm.fsdp.utils.device")
    dev.IS_NPU_AVAILABLE = False
    sys.modules[dev.__name__] = dev

    class ShortConvolution(torch.nn.Conv1d):
        def __init__(self, hidden_size, kernel_size, activation="silu", **_):
            super().__init__(hidden_size, hidden_size, kernel_size, groups=hidden_size, padding=kernel_size - 1,
                             bias=False)

        def forward(self, x, cache=None, output_final_state=False, cu_seqlens=None):  # x [B, T, C]
            assert cache is None and cu_seqlens is None
            y = F.conv1d(x.transpose(1, 2), self.weight, padding=self.kernel_size[0] - 1, groups=self.groups)
            return F.silu(y[..., : x.shape[1]]).transpose(1, 2), None

    def chunk_kda(q, k, v, g, beta, A_log, dt_bias, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                  safe_gate=False, lower_bound=None, **_):
        h, d = g.shape[-2:]
        a = A_log.float().reshape(h, 1).exp()
        x = g.float() + dt_bias.float().reshape(h, d)
        g = lower_bound * torch.sigmoid(a * x) if safe_gate else -a * F.softplus(x)
        beta = torch.sigmoid(beta.float()) if use_beta_sigmoid_in_kernel else beta
        return chunk_kimi_delta_attention(q, k, v, g=g, beta=beta, initial_state=initial_state,
                                          output_final_state=output_final_state,
                                          use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)

    sys.modules["fla.modules"].ShortConvolution = ShortConvolution
    kda = types.ModuleType("fla.ops.kda")
    kda.chunk_kda = chunk_kda
    kda.fused_recurrent_kda = None
    sys.modules["fla.ops.kda"] = kda
    utils = types.ModuleType("fla.utils")
    utils.tensor_cache = lambda f: f
    sys.modules["fla.utils"] = utils

    class KimiLinearConfig(PretrainedConfig):
        model_type = "kimi_linear"

        def __init__(self, **kw):
            super().__init__(**{k: kw.pop(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id",
                                                       "tie_word_embeddings") if k in kw})
            for k, v in kw.items():
                setattr(self, k, v)

        def is_kda_layer(self, i: int) -> bool:
            return i + 1 in self.linear_attn_config["kda_layers"]

        @property
        def is_mla(self) -> bool:
            return True

    pkg_dir = tempfile.mkdtemp(prefix="msk3-")
    os.makedirs(os.path.join(pkg_dir, "msk3"))
    shutil.copy(os.path.join(mindspeed_dir, "modeling_kimi_linear.py"), os.path.join(pkg_dir, "msk3"))
    open(os.path.join(pkg_dir, "msk3", "__init__.py"), "w").close()
    cfgmod = types.ModuleType("msk3.configuration_kimi_k3")
    cfgmod.KimiLinearConfig = KimiLinearConfig
    sys.modules["msk3.configuration_kimi_k3"] = cfgmod
    sys.path.insert(0, pkg_dir)
    import msk3.modeling_kimi_linear as ref
    make_mask = ref.create_causal_mask

    def create_causal_mask(config, input_embeds, attention_mask, past_key_values, position_ids=None, **_):
        # transformers 5.x renamed input_embeds; always materialise the mask (eager attention).
        return make_mask(config=config, inputs_embeds=input_embeds, attention_mask=attention_mask,
                         past_key_values=past_key_values, position_ids=position_ids, allow_is_causal_skip=False)

    ref.create_causal_mask = create_causal_mask
    return ref, KimiLinearConfig


def make_k3(out_root: str, seed: int, mindspeed_dir: str) -> None:
    ref, KimiLinearConfig = install_stubs(mindspeed_dir)
    config = KimiLinearConfig(**json.loads(json.dumps(K3_TEXT)), pad_token_id=None, use_cache=False,
                              initializer_range=0.02)
    torch.manual_seed(seed)
    model = ref.KimiLinearForCausalLM(config).eval()
    model.config._attn_implementation = "eager"  # the file forces flash_attention_2 at init
    randomize(model, seed)
    rng = np.random.default_rng(seed)
    tensors = {}
    with torch.no_grad():
        for name, t in model.state_dict().items():
            hub = "language_model." + name
            parts = name.split(".")
            if "experts" in parts and parts[-2] in ("w1", "w2", "w3"):
                out_f, in_f = t.shape
                packed = rng.integers(0, 256, (out_f, in_f // 2), dtype=np.uint8)
                scale = (127 - 5 + rng.integers(-1, 2, (out_f, in_f // 32))).astype(np.uint8)
                t.copy_(torch.from_numpy(mxfp4_dequant(packed, scale)))
                tensors[hub + "_packed"] = torch.from_numpy(packed)
                tensors[hub + "_scale"] = torch.from_numpy(scale)
            elif parts[-1] == "A_log":  # released layout: F32 zero-padded to 128
                tensors[hub] = torch.cat([t.float(), torch.zeros(128 - t.shape[0])])
            else:
                tensors[hub] = t.detach().clone()
        tensors["vision_tower.encoder.final_layernorm.weight"] = torch.ones(16)
        tensors["mm_projector.post_norm.weight"] = torch.ones(K3_TEXT["hidden_size"])

        def logits_of(ids):
            hidden = model(input_ids=ids, use_cache=False).hidden_states
            return model.lm_head(hidden).float()

        gen = torch.Generator().manual_seed(seed + 1)
        ids = torch.randint(0, K3_TEXT["vocab_size"], (2, SEQ), generator=gen)
        logits = logits_of(ids)
        # Causality check: the eager mask must be in force (a prefix's logits do not change).
        assert torch.allclose(logits_of(ids[:, :20]), logits[:, :20], atol=1e-5), "reference MLA is not causal"
        prompt = ids[:, :12]
        seq = prompt
        for _ in range(NEW):
            seq = torch.cat([seq, logits_of(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
        greedy = seq[:, prompt.shape[1]:]
    save_fixture(os.path.join(out_root, "k3"), K3_CONFIG, tensors,
                 {"input_ids": ids.numpy(), "logits": logits.numpy(), "prompt": prompt.numpy(),
                  "greedy": greedy.numpy()})
    print(f"k3: logits {tuple(logits.shape)}, greedy {greedy.tolist()}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(HERE, "fixtures"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mindspeed-dir", help="folder holding MindSpeed-MM's kimi_k3/modeling_kimi_linear.py")
    args = p.parse_args()
    torch.set_grad_enabled(False)
    os.makedirs(args.out, exist_ok=True)
    make_kimi_linear(args.out, args.seed)
    if args.mindspeed_dir:
        make_k3(args.out, args.seed, args.mindspeed_dir)


if __name__ == "__main__":
    main()
