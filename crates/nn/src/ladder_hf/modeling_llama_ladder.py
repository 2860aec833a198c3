# Written by ferrolm beside every Ladder Transformer checkpoint, so that
#   AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)
# loads it and gives ferrolm's logits and loss (for transformers 5.x; 4.x from 4.56 also works).
#
# The weights and tensor names are a Llama's; only the order of the residual stream differs.
# State is a pair (h, p), both the token embeddings at first. Layer i computes
#
#   standard layer:  a = h + Attn_i(norm1_i(h));  m = a + MLP_i(norm2_i(a))
#   Ladder layer:    a = h + Attn_i(norm1_i(p));  m = a + MLP_i(norm2_i(h))
#
# then h = m, p = a; after the last layer the logits are lm_head(norm(h)). A Ladder layer's
# attention reads the stream without the previous MLP's output, and its MLP reads it without its
# own attention's output: each branch's output is added one branch late, which is what lets a
# tensor-parallel all-reduce overlap the next branch. Every module here is transformers' Llama's.
import inspect

import torch
from transformers import LlamaForCausalLM, LlamaModel
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast

from .configuration_llama_ladder import LlamaLadderConfig


class LlamaLadderModel(LlamaModel):
    config_class = LlamaLadderConfig

    def __init__(self, config):
        super().__init__(config)
        self.ladder = config.ladder_indices()
        # transformers 5 names the cache argument past_key_values, 4.x past_key_value.
        params = inspect.signature(self.layers[0].self_attn.forward).parameters
        self._cache_arg = "past_key_values" if "past_key_values" in params else "past_key_value"

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, cache_position=None, **kwargs):
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache is None:
            use_cache = self.config.use_cache
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        if cache_position is None:
            cache_position = torch.arange(past, past + inputs_embeds.shape[1], device=inputs_embeds.device)
        if position_ids is None:
            position_ids = cache_position.unsqueeze(0)
        mask_kwargs = dict(config=self.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                           past_key_values=past_key_values, position_ids=position_ids)
        if "cache_position" in inspect.signature(create_causal_mask).parameters:
            mask_kwargs["cache_position"] = cache_position
        mask = create_causal_mask(**mask_kwargs)
        rope = self.rotary_emb(inputs_embeds, position_ids=position_ids)
        attn_kwargs = {self._cache_arg: past_key_values, "cache_position": cache_position}
        h = p = inputs_embeds
        for i, layer in enumerate(self.layers[: self.config.num_hidden_layers]):
            ladder = i in self.ladder
            attn, _ = layer.self_attn(hidden_states=layer.input_layernorm(p if ladder else h), attention_mask=mask,
                                      position_ids=position_ids, position_embeddings=rope, **attn_kwargs)
            a = h + attn
            m = a + layer.mlp(layer.post_attention_layernorm(h if ladder else a))
            h, p = m, a
        return BaseModelOutputWithPast(last_hidden_state=self.norm(h),
                                       past_key_values=past_key_values if use_cache else None)


class LlamaLadderForCausalLM(LlamaForCausalLM):
    config_class = LlamaLadderConfig

    def __init__(self, config):
        super().__init__(config)
        self.model = LlamaLadderModel(config)
        self.post_init()
