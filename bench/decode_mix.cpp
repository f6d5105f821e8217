// What the bit-plane decode costs on top of the multiply-adds, on this core.
//
// The exact attention keeps one fp32 multiply-add per (token, channel, query
// head) in a fixed order, so the FMA count is fixed (bench_attention's compute
// floor counts it). The codes must also become floats in SIMD lanes, and on the
// AVX-512 GFNI path each 16-lane code vector costs two instructions (a byte
// permute or a GF2P8AFFINEQB pick, then VCVTDQ2PS) shared by the 4 query heads
// of a Llama-3-8B kv head (8 FMAs per channel and 32-token block), plus the bit
// transposes of the plane words. This binary runs those instruction mixes from
// registers (no memory traffic, no dependence on data) and prints each as a
// multiple of the same number of FMAs alone, in the same run:
//   fma        8 FMAs per step (8 independent sums): the compute floor's loop
//   scores     per channel: 2 VPERMB + 2 VCVTDQ2PS + 8 FMAs, and per 16 channels
//              the transposes of 4 planes (4 + 4 + 8 unpacks, 8 GF2P8AFFINEQB):
//              score_block_fused_gfni's mix for the anchor of 8 = 4 + 4
//   values     per token pair: 2 GF2P8AFFINEQB + 2 VCVTDQ2PS + 8 FMAs, and per
//              16 pairs 4 byte shuffles and 4 + 4 + 8 unpacks:
//              add_values_pairs_gfni's mix for the same anchor
//   one_op     per step: 2 VPERMPS + 8 FMAs: a decode of one instruction per
//              16 codes and nothing else, which no kernel here reaches (codes
//              would have to arrive one per 32-bit lane); the least any decode
//              of codes into lanes can add
// These are the fewest instructions those kernels can issue for 4 planes (the
// kernels themselves transpose 8 planes' worth), so the ratios are lower bounds
// of the two kernels' time against their share of the compute floor. x86-64
// with AVX-512 (F, BW, VBMI) and GFNI only; elsewhere the benchmarks report an
// error and skip.
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>

namespace {

constexpr std::int64_t steps_per_loop = 16;

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))

bool cpu_has_mix() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("gfni");
}

// zmm0-7: the 8 sums; zmm30: the broadcast query or weight; zmm16, zmm17: picked
// codes; zmm18, zmm19: codes as floats; zmm8-15: transposed plane bytes; zmm20-27: plane words and
// unpacks; zmm28, zmm29: permute index and GF2P8AFFINEQB matrix; k1: the zero-extend mask.
#define LYNX_FMA8(x, y)                                              \
  "vfmadd231ps %%zmm" #x ", %%zmm30, %%zmm0\n\tvfmadd231ps %%zmm" #y \
  ", %%zmm30, %%zmm1\n\t"                                            \
  "vfmadd231ps %%zmm" #x ", %%zmm30, %%zmm2\n\tvfmadd231ps %%zmm" #y \
  ", %%zmm30, %%zmm3\n\t"                                            \
  "vfmadd231ps %%zmm" #x ", %%zmm30, %%zmm4\n\tvfmadd231ps %%zmm" #y \
  ", %%zmm30, %%zmm5\n\t"                                            \
  "vfmadd231ps %%zmm" #x ", %%zmm30, %%zmm6\n\tvfmadd231ps %%zmm" #y ", %%zmm30, %%zmm7\n\t"
#define LYNX_X4(s) s s s s
#define LYNX_X16(s) LYNX_X4(LYNX_X4(s))
// one channel of a block: two 16-token halves picked, converted, multiplied
#define LYNX_SCORE_STEP(src)            \
  "vpermb %%zmm" #src                   \
  ", %%zmm28, %%zmm16%{%%k1%}%{z%}\n\t" \
  "vpermb %%zmm" #src                   \
  ", %%zmm28, %%zmm17%{%%k1%}%{z%}\n\t" \
  "vcvtdq2ps %%zmm16, %%zmm18\n\tvcvtdq2ps %%zmm17, %%zmm19\n\t" LYNX_FMA8(18, 19)
// one token pair of 16 channels: two picks, converted, multiplied
#define LYNX_VALUE_STEP(src)      \
  "vgf2p8affineqb $0, %%zmm" #src \
  ", %%zmm29, %%zmm16\n\t"        \
  "vgf2p8affineqb $0, %%zmm" #src \
  ", %%zmm29, %%zmm17\n\t"        \
  "vcvtdq2ps %%zmm16, %%zmm18\n\tvcvtdq2ps %%zmm17, %%zmm19\n\t" LYNX_FMA8(18, 19)
// the byte interleave of 4 plane registers (zmm20-23) into zmm24-27, then zmm8-15
#define LYNX_UNPACK_4_PLANES                                                         \
  "vpunpcklbw %%zmm21, %%zmm20, %%zmm24\n\tvpunpckhbw %%zmm21, %%zmm20, %%zmm25\n\t" \
  "vpunpcklbw %%zmm23, %%zmm22, %%zmm26\n\tvpunpckhbw %%zmm23, %%zmm22, %%zmm27\n\t" \
  "vpunpcklwd %%zmm26, %%zmm24, %%zmm8\n\tvpunpckhwd %%zmm26, %%zmm24, %%zmm9\n\t"   \
  "vpunpcklwd %%zmm27, %%zmm25, %%zmm10\n\tvpunpckhwd %%zmm27, %%zmm25, %%zmm11\n\t" \
  "vpunpckldq %%zmm31, %%zmm8, %%zmm12\n\tvpunpckhdq %%zmm31, %%zmm8, %%zmm13\n\t"   \
  "vpunpckldq %%zmm31, %%zmm9, %%zmm14\n\tvpunpckhdq %%zmm31, %%zmm9, %%zmm15\n\t"   \
  "vpunpckldq %%zmm31, %%zmm10, %%zmm8\n\tvpunpckhdq %%zmm31, %%zmm10, %%zmm9\n\t"   \
  "vpunpckldq %%zmm31, %%zmm11, %%zmm10\n\tvpunpckhdq %%zmm31, %%zmm11, %%zmm11\n\t"
#define LYNX_GF2P8_8                                                                             \
  "vgf2p8affineqb $0, %%zmm8, %%zmm29, %%zmm8\n\tvgf2p8affineqb $0, %%zmm9, %%zmm29, %%zmm9\n\t" \
  "vgf2p8affineqb $0, %%zmm10, %%zmm29, %%zmm10\n\tvgf2p8affineqb $0, %%zmm11, %%zmm29, "        \
  "%%zmm11\n\t"                                                                                  \
  "vgf2p8affineqb $0, %%zmm12, %%zmm29, %%zmm12\n\tvgf2p8affineqb $0, %%zmm13, %%zmm29, "        \
  "%%zmm13\n\t"                                                                                  \
  "vgf2p8affineqb $0, %%zmm14, %%zmm29, %%zmm14\n\tvgf2p8affineqb $0, %%zmm15, %%zmm29, "        \
  "%%zmm15\n\t"
#define LYNX_SHUFFLE_4_PLANES                                                  \
  "vpshufb %%zmm28, %%zmm20, %%zmm20\n\tvpshufb %%zmm28, %%zmm21, %%zmm21\n\t" \
  "vpshufb %%zmm28, %%zmm22, %%zmm22\n\tvpshufb %%zmm28, %%zmm23, %%zmm23\n\t"

#define LYNX_CLOBBERS                                                                           \
  "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",      \
      "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18", "xmm19", "xmm20", \
      "xmm21", "xmm22", "xmm23", "xmm24", "xmm25", "xmm26", "xmm27", "xmm28", "xmm29", "xmm30", \
      "xmm31", "k1", "cc"

#define LYNX_MIX_TARGET __attribute__((target("avx512f,avx512bw,avx512vbmi,gfni")))

LYNX_MIX_TARGET void setup_registers() {
  // nonzero, finite inputs (no denormals: the sums stay small over a run)
  asm volatile(
      "vpternlogd $0xFF, %%zmm31, %%zmm31, %%zmm31\n\t"
      "vpsrld $26, %%zmm31, %%zmm20\n\tvpsrld $27, %%zmm31, %%zmm21\n\t"
      "vpsrld $28, %%zmm31, %%zmm22\n\tvpsrld $29, %%zmm31, %%zmm23\n\t"
      "vpsrld $30, %%zmm31, %%zmm28\n\tvpsrld $25, %%zmm31, %%zmm29\n\t"
      "vpxord %%zmm31, %%zmm31, %%zmm31\n\t"
      "vcvtdq2ps %%zmm29, %%zmm30\n\tvrcp14ps %%zmm30, %%zmm30\n\t"
      "vmovaps %%zmm30, %%zmm18\n\tvmovaps %%zmm30, %%zmm19\n\t"
      "vpxord %%zmm0, %%zmm0, %%zmm0\n\tvmovaps %%zmm0, %%zmm1\n\tvmovaps %%zmm0, %%zmm2\n\t"
      "vmovaps %%zmm0, %%zmm3\n\tvmovaps %%zmm0, %%zmm4\n\tvmovaps %%zmm0, %%zmm5\n\t"
      "vmovaps %%zmm0, %%zmm6\n\tvmovaps %%zmm0, %%zmm7\n\t"
      "movabsq $0x1111111111111111, %%rax\n\tkmovq %%rax, %%k1\n\t" ::
          : LYNX_CLOBBERS, "rax");
}

LYNX_MIX_TARGET void run_fma(std::int64_t loops) {
  asm volatile("1:\n\t" LYNX_X16(LYNX_FMA8(18, 19)) "dec %0\n\tjnz 1b\n\t"
               : "+r"(loops)
               :
               : LYNX_CLOBBERS);
}

LYNX_MIX_TARGET void run_scores(std::int64_t loops) {
  asm volatile("1:\n\t" LYNX_UNPACK_4_PLANES LYNX_GF2P8_8 LYNX_X4(LYNX_SCORE_STEP(
      8) LYNX_SCORE_STEP(9) LYNX_SCORE_STEP(10) LYNX_SCORE_STEP(11)) "dec %0\n\tjnz 1b\n\t"
               : "+r"(loops)
               :
               : LYNX_CLOBBERS);
}

LYNX_MIX_TARGET void run_values(std::int64_t loops) {
  asm volatile("1:\n\t" LYNX_SHUFFLE_4_PLANES LYNX_UNPACK_4_PLANES LYNX_X4(LYNX_VALUE_STEP(
      12) LYNX_VALUE_STEP(13) LYNX_VALUE_STEP(14) LYNX_VALUE_STEP(15)) "dec %0\n\tjnz 1b\n\t"
               : "+r"(loops)
               :
               : LYNX_CLOBBERS);
}

LYNX_MIX_TARGET void run_one_op(std::int64_t loops) {
  asm volatile("1:\n\t" LYNX_X16(
                   "vpermps %%zmm30, %%zmm20, %%zmm18\n\t"
                   "vpermps %%zmm30, %%zmm21, %%zmm19\n\t" LYNX_FMA8(18, 19)) "dec %0\n\tjnz 1b\n\t"
               : "+r"(loops)
               :
               : LYNX_CLOBBERS);
}

#else

bool cpu_has_mix() { return false; }
void run_one_op(std::int64_t) {}
void setup_registers() {}
void run_fma(std::int64_t) {}
void run_scores(std::int64_t) {}
void run_values(std::int64_t) {}

#endif

// The mixes, in the order of the table; the first is the baseline of the others.
struct mix {
  const char* name;
  void (*run)(std::int64_t loops);
  double ns_per_step;  // from the last (reported) call of its benchmark
};
mix mixes[] = {{"fma", run_fma, 0.0},
               {"scores_anchor", run_scores, 0.0},
               {"values_anchor", run_values, 0.0},
               {"one_op", run_one_op, 0.0}};

void bm_mix(benchmark::State& state, mix& m) {
  if (!cpu_has_mix()) {
    state.SkipWithError("needs x86-64 with AVX-512 F, BW, VBMI and GFNI");
    return;
  }
  constexpr std::int64_t loops = 1 << 14;
  setup_registers();
  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) m.run(loops);
  const std::chrono::duration<double, std::nano> elapsed = std::chrono::steady_clock::now() - start;
  const double steps = static_cast<double>(state.iterations()) * loops * steps_per_loop;
  state.SetItemsProcessed(static_cast<std::int64_t>(steps));
  m.ns_per_step = elapsed.count() / steps;
  state.counters["ns_per_step"] = m.ns_per_step;
}

}  // namespace

int main(int argc, char** argv) {
  for (mix& m : mixes)
    benchmark::RegisterBenchmark((std::string("mix/") + m.name).c_str(), bm_mix, std::ref(m))
        ->UseRealTime();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  const double base = mixes[0].ns_per_step;
  if (base <= 0.0) return 0;
  std::printf(
      "\nInstruction mixes per step (8 FMAs: one channel x 32 tokens x 4 heads for the "
      "scores, one token pair x 16 channels x 4 heads for the values)\n");
  std::printf("%-16s %10s %10s\n", "mix", "ns/step", "x fma");
  for (const mix& m : mixes)
    if (m.ns_per_step > 0.0)
      std::printf("%-16s %10.3f %9.2fx\n", m.name, m.ns_per_step, m.ns_per_step / base);
  return 0;
}
