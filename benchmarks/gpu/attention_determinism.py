"""Is the attention backward bitwise repeatable? SDPA's own kernel (cuDNN on Hopper), then FA4
behind SDPA (``train.attention_kernel = "fa4"``): the same q, k, v and output gradient run five
times each against a first run, at the reference shape (b 4, s 2048, 16 heads of 128, causal, bf16).

    bash benchmarks/gpu/fa4_install.sh && python3 benchmarks/gpu/attention_determinism.py
"""

import torch
import torch.nn.functional as F


def outputs(q, k, v, grad_out):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    out.backward(grad_out.transpose(1, 2))
    return out.detach(), q.grad, k.grad, v.grad


def main() -> None:
    torch.manual_seed(0)
    inputs = [torch.randn(4, 2048, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    for kernel in ("sdpa (cuDNN)", "fa4"):
        if kernel == "fa4":
            from mtl.parallel.backend_local.fa4 import activate_fa4

            activate_fa4(torch.device("cuda"))
        first = outputs(*inputs)
        repeats = [all(torch.equal(a, b) for a, b in zip(first, outputs(*inputs))) for _ in range(5)]
        print(f"{kernel}: output, dq, dk, dv bitwise equal to the first run in {sum(repeats)} of 5 repeats", flush=True)


if __name__ == "__main__":
    main()
