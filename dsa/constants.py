"""Every layout constant and model dimension of `dsa`, defined once.

The byte layouts of the two caches are described in SPEC.md; the numbers that
describe them live here and nowhere else.
"""

# --- MLA (DeepSeek-V3.2 / GLM-5) -------------------------------------------
KV_LORA_RANK = 512  # c_kv width == d_v (V is the first 512 values of a row)
ROPE_DIM = 64  # qk_rope_head_dim (k_pe width)
D_QK = KV_LORA_RANK + ROPE_DIM  # 576: absorbed query / cache row width
D_V = KV_LORA_RANK  # 512

# --- fp8 e4m3fn --------------------------------------------------------------
FP8_MAX = 448.0  # largest finite e4m3fn value (AMD's e4m3fnuz would be 224)
FP8_AMAX_EPS = 1e-4  # scale = max(amax, eps) / 448

# --- MLA cache, fp8_ds_mla (FlashMLA's V3.2 FP8 format) ----------------------
FP8_DS_MLA_GROUP = 128  # values per scale
FP8_DS_MLA_NUM_GROUPS = KV_LORA_RANK // FP8_DS_MLA_GROUP  # 4
FP8_DS_MLA_SCALE_OFFSET = KV_LORA_RANK  # bytes 512..527: four fp32 scales
FP8_DS_MLA_ROPE_OFFSET = FP8_DS_MLA_SCALE_OFFSET + 4 * FP8_DS_MLA_NUM_GROUPS  # 528
FP8_DS_MLA_ROW_BYTES = FP8_DS_MLA_ROPE_OFFSET + 2 * ROPE_DIM  # 656

# --- Lightning indexer ---------------------------------------------------------
INDEXER_NUM_HEADS = 64
INDEXER_HEAD_DIM = 128
INDEXER_ROPE_DIM = 64  # rope on the FIRST 64 dims of an indexer head
INDEXER_ROW_BYTES = INDEXER_HEAD_DIM + 4  # 132: 128 fp8 values + one fp32 scale
INDEX_TOPK = 2048

INT32_MAX = 2**31 - 1  # the largest int32 slot; index lists are int32

# --- Paged caches ----------------------------------------------------------------
MIN_BLOCK_SIZE = 1
MAX_BLOCK_SIZE = 256
SUPPORTED_BLOCK_SIZES = tuple(1 << i for i in range(9))  # 1, 2, 4, ..., 256

# --- Reference device (NVIDIA H200), the ceilings benchmarks compare against ---
H200_NUM_SMS = 132
H200_COPY_BYTES_PER_S = 4.3e12  # device-to-device copy, read + write, measured
H200_BF16_FLOPS = 690e12  # bf16 matmul through PyTorch, measured
H200_FP8_FLOPS = 1270e12  # fp8 matmul through PyTorch, measured
