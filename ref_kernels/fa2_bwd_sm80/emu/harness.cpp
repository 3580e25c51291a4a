// Runs the backward kernels of kernel.cu on the CPU (x86-64 Linux): the fiber runtime behind
// host.h, and a main that launches preprocess, dkdv and convert (or the deterministic dQ pass) in
// the order the Python runtime does, on raw little-endian arrays in a directory.
//
//   g++ -O1 -std=c++17 -DFA2B_HOST_EMU -D__CUDA_ARCH__=900 -include emu/host.h -I. [-D...] emu/harness.cpp
//   ./a.out B Hq Hkv Nq Nk sm_scale deterministic DIR     (DIR: q k v o do lse .bin in; dq dk dv .bin out)
//   ./a.out --smem                                        (prints SMEM_BYTES DQ_SMEM_BYTES)
#include "kernel.cu"

EmuDim threadIdx, blockIdx, gridDim, blockDim;
alignas(128) unsigned char smem[EMU_SMEM_MAX];

extern "C" void emu_switch(void** save_sp, void* to_sp);
asm(R"(
.text
.globl emu_switch
.type emu_switch, @function
emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
)");

namespace emu {

constexpr size_t STACK_BYTES = 256 << 10;
enum Kind { NONE, LDM, LDMT, MMA_F16, MMA_BF16, SHFL };

struct Copy { uint32_t dst; const unsigned char* src; int bytes, src_bytes; };
struct Fiber {
  void* sp = nullptr;
  std::vector<char> stack;
  bool done = false, blocked = false;
  std::vector<std::vector<Copy>> groups;   // committed cp.async groups, oldest first
  std::vector<Copy> open;                  // issued, not committed yet
};
struct Warp {
  int arrived = 0;
  Kind kind[32];
  uint32_t in[32][8];
  float fin[32][4];
  uint32_t out[32][4];
  float fout[32][4];
};

static std::vector<Fiber> fibers;
static std::vector<Warp> warps;
static int cur = -1, bar_arrived = 0;
static void* sched_sp = nullptr;
static size_t smem_limit = 0;
static std::function<void()> entry;
// Schedules: ROUND_ROBIN (warps in near lockstep), LOW / HIGH (the lowest / highest runnable
// thread first: one warp runs ahead until a barrier stops it, which exposes a missing barrier in
// either direction), RANDOM. Set by EMU_SCHEDULE=rr|low|high|random:SEED.
enum Schedule { ROUND_ROBIN, LOW, HIGH, RANDOM };
static Schedule schedule = ROUND_ROBIN;
static unsigned long long rng = 1;
static int rr_next = 0;

void set_schedule(const char* text) {
  if (!text || !std::strcmp(text, "rr")) schedule = ROUND_ROBIN;
  else if (!std::strcmp(text, "low")) schedule = LOW;
  else if (!std::strcmp(text, "high")) schedule = HIGH;
  else if (!std::strncmp(text, "random:", 7)) { schedule = RANDOM; rng = std::strtoull(text + 7, nullptr, 10) + 1; }
  else fail("EMU_SCHEDULE must be rr, low, high or random:SEED");
}

void fail(const char* what, long long a, long long b) {
  std::fprintf(stderr, "EMU ERROR: %s (%lld, %lld) thread %d block (%u, %u, %u)\n", what, a, b, cur, blockIdx.x,
               blockIdx.y, blockIdx.z);
  std::exit(3);
}

static void yield_blocked() {
  fibers[cur].blocked = true;
  emu_switch(&fibers[cur].sp, sched_sp);
}

static void trampoline() {
  entry();
  if (!fibers[cur].groups.empty() || !fibers[cur].open.empty()) fail("cp.async still in flight at thread exit");
  fibers[cur].done = true;
  emu_switch(&fibers[cur].sp, sched_sp);
  fail("a finished fiber was resumed");
}

void check_smem(uint32_t addr, int bytes) {
  if (addr + static_cast<size_t>(bytes) > smem_limit) fail("shared-memory access past the dynamic size", addr, bytes);
}

void syncthreads() {
  if (++bar_arrived == static_cast<int>(fibers.size())) {
    bar_arrived = 0;
    for (auto& f : fibers) f.blocked = false;
    return;
  }
  yield_blocked();
}

// Deposit this lane's operands; the last lane of the warp computes every lane's result.
static void compute(Warp& w, Kind k);
static Warp& warp_op(Kind k, const uint32_t* in, int n_in, const float* fin, int n_fin) {
  Warp& w = warps[cur / 32];
  const int lane = cur % 32;
  w.kind[lane] = k;
  std::memcpy(w.in[lane], in, n_in * 4);
  if (n_fin) std::memcpy(w.fin[lane], fin, n_fin * 4);
  if (++w.arrived == 32) {
    w.arrived = 0;
    for (int l = 0; l < 32; ++l)
      if (w.kind[l] != k) fail("divergent warp operation (lanes reached different ones)", l, w.kind[l]);
    compute(w, k);
    for (int l = 0; l < 32; ++l) fibers[(cur / 32) * 32 + l].blocked = false;
  } else {
    yield_blocked();
  }
  return w;
}

static uint16_t ld16(uint32_t addr) {
  uint16_t x;
  std::memcpy(&x, smem + addr, 2);
  return x;
}
static float bits_to_f32(uint16_t x, bool bf16) {
  if (bf16) return __uint_as_float(static_cast<uint32_t>(x) << 16);
  _Float16 h;
  std::memcpy(&h, &x, 2);
  return static_cast<float>(h);
}

static void compute(Warp& w, Kind k) {
  if (k == SHFL) {
    for (int t = 0; t < 32; ++t) w.fout[t][0] = w.fin[t ^ static_cast<int>(w.in[t][0])][0];
  } else if (k == LDM || k == LDMT) {
    for (int t = 0; t < 32; ++t) {
      const uint32_t a = w.in[t][0];
      if (a % 16) fail("ldmatrix row address not 16-byte aligned", a);
      check_smem(a, 16);
    }
    for (int t = 0; t < 32; ++t)
      for (int i = 0; i < 4; ++i) {
        if (k == LDM) {   // row t / 4 of matrix i, elements 2 (t % 4), +1
          std::memcpy(&w.out[t][i], smem + w.in[8 * i + t / 4][0] + (t % 4) * 4, 4);
        } else {          // transposed: rows 2 (t % 4), +1 of matrix i, column t / 4
          const uint32_t lo = ld16(w.in[8 * i + 2 * (t % 4)][0] + (t / 4) * 2);
          const uint32_t hi = ld16(w.in[8 * i + 2 * (t % 4) + 1][0] + (t / 4) * 2);
          w.out[t][i] = lo | (hi << 16);
        }
      }
  } else {   // mma.m16n8k16: rebuild A (16x16), B (16x8 k x n), C (16x8) from the fragments
    const bool bf16 = k == MMA_BF16;
    float A[16][16], B[16][8], C[16][8];
    for (int t = 0; t < 32; ++t) {
      const int g = t / 4, tq = t % 4;
      const uint32_t* a = w.in[t];
      for (int h = 0; h < 2; ++h) {
        A[g][2 * tq + h] = bits_to_f32(a[0] >> (16 * h), bf16);
        A[g + 8][2 * tq + h] = bits_to_f32(a[1] >> (16 * h), bf16);
        A[g][2 * tq + 8 + h] = bits_to_f32(a[2] >> (16 * h), bf16);
        A[g + 8][2 * tq + 8 + h] = bits_to_f32(a[3] >> (16 * h), bf16);
        B[2 * tq + h][g] = bits_to_f32(a[4] >> (16 * h), bf16);
        B[2 * tq + 8 + h][g] = bits_to_f32(a[5] >> (16 * h), bf16);
        C[g][2 * tq + h] = w.fin[t][h];
        C[g + 8][2 * tq + h] = w.fin[t][2 + h];
      }
    }
    for (int t = 0; t < 32; ++t) {
      const int g = t / 4, tq = t % 4;
      for (int e = 0; e < 4; ++e) {
        const int row = g + (e / 2) * 8, col = 2 * tq + e % 2;
        double acc = C[row][col];
        for (int kk = 0; kk < 16; ++kk) acc += static_cast<double>(A[row][kk]) * B[kk][col];
        w.fout[t][e] = static_cast<float>(acc);
      }
    }
  }
}

float shfl_xor(float v, int lane_mask) {
  const uint32_t m = static_cast<uint32_t>(lane_mask);
  return warp_op(SHFL, &m, 1, &v, 1).fout[cur % 32][0];
}

void ldmatrix(uint32_t (&r)[4], uint32_t addr, bool trans) {
  Warp& w = warp_op(trans ? LDMT : LDM, &addr, 1, nullptr, 0);
  std::memcpy(r, w.out[cur % 32], 16);
}

void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, bool bf16) {
  const uint32_t in[6] = {a[0], a[1], a[2], a[3], b0, b1};
  Warp& w = warp_op(bf16 ? MMA_BF16 : MMA_F16, in, 6, c, 4);
  std::memcpy(c, w.fout[cur % 32], 16);
}

// cp.async: queued per thread, performed when the thread waits for its group (so a reader that
// skips the wait or the barrier sees the poison the CTA's shared memory starts with).
void cp_async(uint32_t dst, const void* src, int bytes, int src_bytes) {
  if (dst % bytes) fail("cp.async destination misaligned", dst, bytes);
  if (reinterpret_cast<uintptr_t>(src) % bytes) fail("cp.async source misaligned", bytes);
  check_smem(dst, bytes);
  fibers[cur].open.push_back(Copy{dst, static_cast<const unsigned char*>(src), bytes, src_bytes});
}
void cp_async_commit() {
  fibers[cur].groups.push_back(fibers[cur].open);
  fibers[cur].open.clear();
}
void cp_async_wait(int pending) {
  auto& gs = fibers[cur].groups;
  while (static_cast<int>(gs.size()) > pending) {
    for (const Copy& c : gs.front()) {
      std::memset(smem + c.dst, 0, c.bytes);
      std::memcpy(smem + c.dst, c.src, c.src_bytes);
    }
    gs.erase(gs.begin());
  }
}

// One CTA: `threads` fibers run `fn` until all return; shared memory starts as 0xff bytes (NaN
// in fp16, bf16 and fp32), so reading what nobody wrote poisons the result.
static void run_cta(int threads, size_t smem_bytes, const std::function<void()>& fn) {
  if (smem_bytes > EMU_SMEM_MAX) fail("dynamic shared memory over the emulator's maximum", smem_bytes);
  smem_limit = smem_bytes;
  std::memset(smem, 0xff, EMU_SMEM_MAX);
  fibers.assign(threads, Fiber());
  warps.assign((threads + 31) / 32, Warp());
  if (threads % 32) fail("block size not a multiple of 32", threads);
  entry = fn;
  bar_arrived = 0;
  rr_next = 0;
  for (auto& f : fibers) {
    f.stack.resize(STACK_BYTES);
    auto top = reinterpret_cast<uintptr_t>(f.stack.data() + STACK_BYTES) & ~uintptr_t(15);
    void** sp = reinterpret_cast<void**>(top);
    *--sp = nullptr;                                     // trampoline's return slot: rsp % 16 == 8 at entry
    *--sp = reinterpret_cast<void*>(&trampoline);
    for (int i = 0; i < 6; ++i) *--sp = nullptr;        // rbp rbx r12-r15
    f.sp = sp;
  }
  for (;;) {   // pick a runnable fiber by the schedule, run it until it blocks or returns
    int live = 0, pick = -1;
    for (int i = 0; i < threads; ++i) {
      const int t = schedule == LOW ? i : schedule == HIGH ? threads - 1 - i : (rr_next + i) % threads;
      if (fibers[t].done) continue;
      ++live;
      if (!fibers[t].blocked && pick < 0) pick = t;
      if (pick >= 0 && schedule != RANDOM) break;
    }
    if (pick < 0 && live == 0) break;
    if (pick < 0) fail("deadlock: every live thread waits at a barrier or warp operation");
    if (schedule == RANDOM) {   // a random runnable fiber: another start point of the scan
      rng = rng * 6364136223846793005ull + 1442695040888963407ull;
      const int start = static_cast<int>((rng >> 33) % threads);
      for (int i = 0; i < threads; ++i) {
        const int t = (start + i) % threads;
        if (!fibers[t].done && !fibers[t].blocked) { pick = t; break; }
      }
    }
    rr_next = pick + 1;
    cur = pick;
    threadIdx = EmuDim{static_cast<unsigned>(cur), 0, 0};
    emu_switch(&sched_sp, fibers[cur].sp);
  }
  cur = -1;
}

void launch(EmuDim grid, int threads, size_t smem_bytes, const std::function<void()>& fn) {
  gridDim = grid;
  blockDim = EmuDim{static_cast<unsigned>(threads), 1, 1};
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        blockIdx = EmuDim{x, y, z};
        run_cta(threads, smem_bytes, fn);
      }
}

}  // namespace emu

#include "emu/main.inc"
