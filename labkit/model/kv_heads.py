"""Change how many K/V heads a grouped-query model has, keeping every query head's view of them.

Query head h reads K/V head h // (num_heads // num_kv_heads): consecutive query heads share a K/V
head. Going to fewer K/V heads (GQA -> MQA) mean-pools each run of consecutive heads' k_proj/v_proj
rows, which is how a model is "uptrained" into fewer heads before fine-tuning, and it costs quality;
going to more (GQA -> MHA) repeats each head for the query heads that already shared it, which
changes no number the model computes and only multiplies the KV cache.
"""

import dataclasses

import torch

from labkit.model.decoder import DecoderModel


def pool_kv_heads(weight: torch.Tensor, num_kv_heads: int, new_num_kv_heads: int) -> torch.Tensor:
    """k_proj/v_proj rows [num_kv_heads * head_dim, ...] regrouped into new_num_kv_heads heads.

    Fewer heads: the mean of each run of num_kv_heads // new_num_kv_heads consecutive heads.
    More heads: each head repeated new_num_kv_heads // num_kv_heads times, in place.
    """
    if num_kv_heads < 1 or new_num_kv_heads < 1:
        raise ValueError(f"head counts must be positive, got {num_kv_heads} -> {new_num_kv_heads}")
    if weight.shape[0] % num_kv_heads:
        raise ValueError(f"{weight.shape[0]} rows do not split into {num_kv_heads} heads")
    heads = weight.reshape(num_kv_heads, weight.shape[0] // num_kv_heads, *weight.shape[1:])
    if num_kv_heads % new_num_kv_heads == 0:
        group = num_kv_heads // new_num_kv_heads
        regrouped = heads.reshape(new_num_kv_heads, group, *heads.shape[1:]).mean(dim=1)
    elif new_num_kv_heads % num_kv_heads == 0:
        regrouped = heads.repeat_interleave(new_num_kv_heads // num_kv_heads, dim=0)
    else:
        raise ValueError(f"cannot regroup {num_kv_heads} K/V heads into {new_num_kv_heads}: "
                         "one count must divide the other")
    return regrouped.reshape(-1, *weight.shape[1:])


def with_kv_heads(model: DecoderModel, new_num_kv_heads: int) -> DecoderModel:
    """A copy of `model` with new_num_kv_heads K/V heads per layer (the original is left as it was)."""
    config = model.config
    if config.num_heads % new_num_kv_heads:
        raise ValueError(f"num_heads ({config.num_heads}) must be a multiple of the new number of "
                         f"K/V heads ({new_num_kv_heads})")
    weights = {}
    for name, tensor in model.state_dict().items():
        if name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias",
                          "self_attn.v_proj.weight", "self_attn.v_proj.bias")):
            tensor = pool_kv_heads(tensor, config.num_kv_heads, new_num_kv_heads)
        weights[name] = tensor
    new_config = dataclasses.replace(config, num_kv_heads=new_num_kv_heads)
    return DecoderModel.from_state_dict(new_config, weights, device=model.device, dtype=model.dtype,
                                        source=f"{model.config.num_kv_heads}->{new_num_kv_heads} K/V heads")
