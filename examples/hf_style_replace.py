"""An existing HuggingFace-style model moved onto the runtime ops with replace_modules, logits unchanged.

    python examples/hf_style_replace.py      (PYTHONPATH=src from a checkout)

transformers is not needed: the small Llama-style decoder below has the structure of HuggingFace's Llama classes
(LlamaRMSNorm with `weight` and `variance_epsilon`, q/k/v/o projections, a gated MLP with an `act_fn` module).
replace_modules recognises the RMSNorm class by that structure, checks on a copy that it computes rms_norm, and
swaps it, the Linear layers and the SiLU for runtime.nn modules with the same parameters.
"""

import copy

import torch
import torch.nn.functional as F
from torch import nn

from runtime.accelerators.testing import RTOL, relative_rms_error
from runtime.nn import replace_modules


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size, intermediate_size):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class LlamaAttention(nn.Module):
    def __init__(self, hidden_size, num_heads):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden_size // num_heads
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.k_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.v_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (
            proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, hidden_size, num_heads, intermediate_size):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(hidden_size)
        self.self_attn = LlamaAttention(hidden_size, num_heads)
        self.post_attention_layernorm = LlamaRMSNorm(hidden_size)
        self.mlp = LlamaMLP(hidden_size, intermediate_size)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, vocab_size=128, hidden_size=32, num_heads=4, intermediate_size=64, num_layers=2):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(hidden_size, num_heads, intermediate_size) for _ in range(num_layers)
        )
        self.norm = LlamaRMSNorm(hidden_size)
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)

    def forward(self, input_ids):
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def main() -> None:
    torch.manual_seed(0)
    failed = False
    for dtype in (torch.float32, torch.bfloat16):
        model = LlamaForCausalLM().to(dtype).eval()
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, LlamaRMSNorm):
                    module.weight.uniform_(0.5, 1.5)  # trained-looking norms, not ones
        input_ids = torch.randint(0, 128, (2, 24))
        reference = copy.deepcopy(model)
        report = replace_modules(model)
        if dtype == torch.float32:
            print(report)
        with torch.no_grad():
            expected, logits = reference(input_ids), model(input_ids)
        error, bound = relative_rms_error(logits, expected), RTOL[dtype]
        print(f"{dtype}: logits relative RMS error {error:.2e} (bound {bound:.0e})")
        failed |= not error <= bound
    if failed:
        raise SystemExit("the logits changed beyond the dtype's bound")


if __name__ == "__main__":
    main()
