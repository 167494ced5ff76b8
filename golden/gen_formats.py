"""Golden data for the number formats: E4M3 conversions from PyTorch, NVFP4 weight
quantization and activation fake-quantization from NVIDIA ModelOpt's NVFP4QTensor.

Every output is produced by torch / ModelOpt only; nothing here imports project code.
Seeded and CPU-only, so re-running writes identical bytes.
"""

import argparse
import json
import warnings
import math
from pathlib import Path

import modelopt
import torch
from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor
from safetensors.torch import save_file

BLOCK = 16
warnings.filterwarnings("ignore")


def provenance(extra: dict) -> dict:
    meta = {
        "generator": "golden/gen_formats.py",
        "torch": torch.__version__,
        "modelopt": modelopt.__version__,
    }
    meta.update({k: str(v) for k, v in extra.items()})
    # One key only: safetensors keeps metadata in a hash map, so several keys would be
    # written in a different order on every run.
    return {"provenance": json.dumps(meta, sort_keys=True)}


# ---------------------------------------------------------------- E4M3
def e4m3_inputs(gen: torch.Generator) -> torch.Tensor:
    all_codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = all_codes[torch.isfinite(all_codes)]
    positives = torch.sort(finite[finite > 0]).values
    mids = (positives[:-1] + positives[1:]) / 2  # exact: short binary fractions
    below = torch.nextafter(mids, torch.zeros_like(mids))
    above = torch.nextafter(mids, torch.full_like(mids, math.inf))
    first_mid = positives[0] / 2
    specials = torch.tensor(
        [0.0, -0.0, math.inf, -math.inf, math.nan, 448.0, 449.0, 463.99, 464.0, 464.01,
         479.9, 480.0, 500.0, 1e6, 3.0e38, 1e-45, 1e-30, 2.0**-10, 2.0**-9, 2.0**-8],
        dtype=torch.float32,
    )
    tiny = torch.stack([first_mid, torch.nextafter(first_mid, torch.tensor(0.0)),
                        torch.nextafter(first_mid, torch.tensor(1.0))])
    log_uniform = torch.exp2(torch.empty(4096).uniform_(-14, 10, generator=gen))
    signs = torch.where(torch.rand(4096, generator=gen) < 0.5, -1.0, 1.0)
    pieces = [finite, mids, below, above, specials, tiny, log_uniform * signs]
    pieces += [-p for p in pieces[1:4]]
    return torch.cat(pieces).float()


def write_e4m3(out: Path, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    inputs = e4m3_inputs(gen)
    codes = inputs.to(torch.float8_e4m3fn).view(torch.uint8)
    decoded = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    bf16_inputs = inputs.to(torch.bfloat16)
    save_file(
        {
            "inputs": inputs.contiguous(),
            "codes": codes.contiguous(),
            "bf16_inputs": bf16_inputs.contiguous(),
            "bf16_codes": bf16_inputs.to(torch.float8_e4m3fn).view(torch.uint8).contiguous(),
            "decoded_all_codes": decoded.contiguous(),
        },
        str(out / "e4m3.safetensors"),
        metadata=provenance({"seed": seed, "conversion": "torch.Tensor.to(torch.float8_e4m3fn)"}),
    )


# ---------------------------------------------------------------- NVFP4 weights
def weight_cases(gen: torch.Generator) -> dict:
    def randn(rows, cols, scale=1.0, dtype=torch.bfloat16):
        return (torch.randn(rows, cols, generator=gen) * scale).to(dtype)

    cases = {}
    cases["normal_64x128"] = randn(64, 128, 0.02)
    cases["normal_f32_48x64"] = randn(48, 64, 0.5, torch.float32)
    cases["kimi_expert_rows_8x7168"] = randn(8, 7168, 0.01)
    cases["kimi_down_rows_16x2048"] = randn(16, 2048, 0.01)
    cases["tall_300x32"] = randn(300, 32, 3.0)

    w = randn(32, 64, 1.0)
    w[::3, 16:32] = 0.0  # all-zero blocks get scale 1.0
    w[5, :] = 0.0
    cases["zero_blocks_32x64"] = w

    w = randn(16, 256, 0.01)
    w[3, 77] = 40.0  # one outlier sets the global scale; other blocks get tiny scales
    w[11, 200] = -25.0
    cases["outliers_16x256"] = w

    w = randn(8, 64, 1.0)
    w[2:6, :] *= 1e-6  # block amax far below amax/2688·2⁻⁹: scale clamps to 2⁻⁹
    w[6, 0:16] = 1e-4
    cases["near_clamp_8x64"] = w

    w = randn(8, 32, 1.0)
    w[0, :] = -0.0
    w[1, 0:16] = torch.tensor([-0.0, 0.0] * 8)
    w[2, 0:16] = -1e-8  # small negatives: ModelOpt sets the sign bit (code 8)
    cases["negative_zero_8x32"] = w

    exps = torch.empty(32, 64).uniform_(-60, 60, generator=gen)
    signs = torch.where(torch.rand(32, 64, generator=gen) < 0.5, -1.0, 1.0)
    cases["huge_dynamic_range_32x64"] = (torch.exp2(exps) * signs).to(torch.bfloat16)

    # Values sitting exactly on E2M1 rounding midpoints once scaled: the block amax is 6 so
    # the block scale is exactly 1 in units of the global scale.
    ties = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0,
                         -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -6.0])
    cases["exact_ties_4x32"] = torch.cat([ties, ties.flip(0)]).repeat(4, 1).to(torch.bfloat16)
    return cases


def write_nvfp4_weights(out: Path, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, w in weight_cases(gen).items():
        qtensor, scale, scale_2 = NVFP4QTensor.quantize(w.clone(), BLOCK)
        dequant = qtensor.dequantize(
            dtype=torch.float32, scale=scale, double_scale=scale_2, block_sizes={-1: BLOCK}
        )
        tensors[f"{name}.input"] = w.contiguous()
        tensors[f"{name}.weight"] = qtensor._quantized_data.contiguous()
        tensors[f"{name}.weight_scale"] = scale.contiguous()
        tensors[f"{name}.weight_scale_2"] = scale_2.float().reshape([]).contiguous()
        tensors[f"{name}.dequant"] = dequant.contiguous()
    save_file(tensors, str(out / "nvfp4_weights.safetensors"),
              metadata=provenance({"seed": seed, "quantizer": "NVFP4QTensor.quantize(w, 16)"}))


# ---------------------------------------------------------------- NVFP4 activations
def write_nvfp4_activations(out: Path, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    tensors = {}

    def add(name, x, input_scale):
        input_scale = torch.tensor(input_scale, dtype=torch.float32)
        qtensor, scale, _ = NVFP4QTensor.quantize(x.clone(), BLOCK, weights_scaling_factor_2=input_scale)
        fake = qtensor.dequantize(dtype=torch.float32, scale=scale, double_scale=input_scale,
                                  block_sizes={-1: BLOCK})
        tensors[f"{name}.input"] = x.clone().contiguous()
        tensors[f"{name}.input_scale"] = input_scale.reshape([]).contiguous()
        tensors[f"{name}.codes"] = qtensor._quantized_data.contiguous()
        tensors[f"{name}.block_scales"] = scale.contiguous()
        tensors[f"{name}.fake_quant"] = fake.contiguous()

    x = (torch.randn(4, 7168, generator=gen) * 0.5).to(torch.bfloat16)
    calibrated = float(x.float().abs().max()) / (6 * 448)
    add("decode_calibrated_4x7168", x, calibrated)
    add("decode_scale_too_small_4x7168", x, calibrated / 64)  # block scales saturate at 448
    add("decode_scale_too_large_4x7168", x, calibrated * 4096)  # block scales clamp at 2⁻⁹
    y = torch.randn(8, 2048, generator=gen)
    y[0, :16] = 0.0
    y[1, 100] = 50.0
    add("down_proj_input_8x2048", y, float(y.abs().max()) / (6 * 448))
    save_file(tensors, str(out / "nvfp4_activations.safetensors"),
              metadata=provenance({"seed": seed, "quantizer": "NVFP4QTensor.quantize(x, 16, weights_scaling_factor_2=input_scale)"}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=20261129)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.use_deterministic_algorithms(True)
    write_e4m3(args.out, args.seed)
    write_nvfp4_weights(args.out, args.seed + 1)
    write_nvfp4_activations(args.out, args.seed + 2)


if __name__ == "__main__":
    main()
