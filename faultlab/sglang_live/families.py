"""Tiny config-only models of each family SGLang 0.5.23 builds different pools for (overrides over the tiny
Llama of :func:`faultlab.sglang_live.harness.write_model`; load them with ``load_format="dummy"``).

What kvguard decides on a model (MLA, sliding-window hybrid, linear-attention / mamba state) is read by SGLang
from these configs' classes: tests build SGLang's own ``ModelConfig`` from them.
"""
QWEN3_NEXT = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "full_attention_interval": 2,
              "linear_num_key_heads": 2, "linear_num_value_heads": 2, "linear_key_head_dim": 16,
              "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "num_experts": 4, "num_experts_per_tok": 2,
              "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "decoder_sparse_step": 1,
              "head_dim": 16}  # GDN linear attention beside full attention (Qwen3.5's family)
NEMOTRON_H = {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "hybrid_override_pattern": "M*M-",
              "mamba_num_heads": 4, "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 1, "mamba_n_groups": 1,
              "conv_kernel": 4,
              "head_dim": 16}  # mamba2 layers beside attention
# NemotronH with one MTP layer (full attention, no mamba layer of its own: SGLang drafts with NemotronHForCausalLMMTP)
NEMOTRON_H_MTP = {**NEMOTRON_H, "num_nextn_predict_layers": 1, "mtp_hybrid_override_pattern": "*"}
DEEPSEEK_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "kv_lora_rank": 32,
               "q_lora_rank": None, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16,
               "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
               "first_k_dense_replace": 1, "n_shared_experts": 1, "topk_group": 1, "n_group": 1}  # MLA
GPT_OSS = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "sliding_window": 16,
           "num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 16,
           "layer_types": ["sliding_attention", "full_attention"]}  # sliding-window hybrid
# grouped-query attention with one MTP layer (GLM-4.5's NEXTN: SGLang drafts with Glm4MoeForCausalLMNextN)
GLM4_MOE_MTP = {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "num_nextn_predict_layers": 1,
                "first_k_dense_replace": 1, "moe_intermediate_size": 32, "n_routed_experts": 4, "n_shared_experts": 1,
                "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
                "norm_topk_prob": True, "use_qk_norm": False, "attention_bias": False, "partial_rotary_factor": 0.5,
                "head_dim": 16}

FAMILIES = {"llama": {}, "qwen3_next": QWEN3_NEXT, "nemotron_h": NEMOTRON_H, "deepseek_v3": DEEPSEEK_V3,
            "gpt_oss": GPT_OSS}
