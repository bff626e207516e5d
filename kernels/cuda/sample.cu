/* Sampling where the logits are (the sample_rows op; its numbered steps are
 * in kernels/pd_kernels.h, the meanings those of model/sampler.c, i.e.
 * vLLM's sampler: vllm/v1/sample/sampler.py and ops/topk_topp_sampler.py).
 *
 * A row is sampled by a cluster of G blocks of SP_CL_THREADS, or by one
 * block of SP_THREADS (G = 1); G follows the batch and the vocabulary (see
 * sp_cluster_size). The row is cut into G × W contiguous runs of ids (W
 * warps a block), block r's warp w owning run r · W + w, its lanes reading it 128
 * bytes a step (sp_layout), so "ties to the lower id" and "the first
 * survivor in id order" come from ballots within a step, a warp's steps in
 * order and exclusive scans over warps and then over the cluster's blocks,
 * never from a sort. Each pass reads the row again (from L2: a 129280-token
 * row is 517 KB), or the weights kept from the pass after the max (wc).
 * (The first version gave each thread a contiguous run of its own: every
 * load of a warp touched 32 lines, and a pass took ~25 µs instead of a few.
 * The second gave a row one block: top-p's ~10 passes over V3's vocabulary
 * took ~600 µs on one SM while the others idled, a quarter of a batch-1
 * decode step; session 18.)
 *
 * Thresholds by radix selection on the bits of a float, 8 bits a pass from
 * the top: top-k and the top logprobs by counts (the k-th largest logit),
 * top-p by mass (the weight at which the heaviest weights first hold
 * top_p of the mass). A selection gives a threshold τ and how many of the
 * ids exactly at τ to keep (the lowest ids among them).
 *
 * Across a cluster (CUDA C++ Programming Guide, "Thread Block Clusters" and
 * "Distributed Shared Memory"): each reduction puts a block's part in its
 * own shared memory, one barrier.cluster, then every block reads all the
 * parts through distributed shared memory and adds them up in rank order,
 * so every block holds the same total and takes the same decisions. The
 * parts alternate between two slots (sp_grp.par): a block writes slot p
 * again only two reductions later, past a barrier that every block reaches
 * after its reads of slot p. The logits themselves are written (steps 1,
 * 3, 4, 4b) between barriers, whose release and acquire at cluster scope
 * order global memory too.
 */
#include "cuda_common.cuh"

#include <cooperative_groups.h>
#include <math.h>
#include <string.h>
#include <type_traits>

namespace cg = cooperative_groups;

#define SP_THREADS 1024
#define SP_WARPS (SP_THREADS / 32)
#define SP_EPS 1e-5f /* vLLM's _SAMPLING_EPS: temperatures below are greedy */
#define SP_WCACHE_MAX ((size_t)256 << 20) /* sp_view.wc's scratch for a call's rows, bytes; past it: recomputed */
#define SP_CL_THREADS 512 /* a block of a cluster: 128 registers a thread (at 1024 the exchanges' values spilled) */
#define SP_CL_MAX 16                      /* blocks a row at most (a non-portable cluster size past 8) */
#define SP_CL_IDS 4096                    /* ids a block at least, when the size is chosen */

typedef struct {
    pd_sample_row row; /* the row's settings: read from here, not kept in registers */
    double d[SP_WARPS];
    float f[SP_WARPS];
    int i[SP_WARPS];
    unsigned hist[2][256]; /* this block's counts, by sp_grp.par */
    double mass[2][256];
    unsigned hsum[256]; /* the cluster's counts and masses, added up */
    double msum[256];
    double xd[2]; /* this block's part of a reduction, by sp_grp.par */
    float xf[2];
    int xi[2], xi2[2];
    unsigned sel_prefix;
    int sel_rest;
    double sel_need;
    int sel_all;
    int n_top;
    int top_id[PD_SAMPLE_MAX_TOP];
    float top_l[PD_SAMPLE_MAX_TOP];
    int chosen_entry;
    float lmax; /* step 2's max and log-sum-exp, for the sampled token's logprob */
    double lse;
    int amax;  /* the scaled logits' argmax: step 9's fallback */
    int found; /* the draw's token in this block's runs, -1: none */
} sp_smem;

/* The cluster that samples a row: this block's rank in it, its size, and
 * the slot the next reduction writes. */
struct sp_grp {
    int rank, n, par;
    int nw; /* warps a block */
};

/* Every thread of every block of the cluster here (n == 1: the block). */
__device__ __forceinline__ void sp_gsync(const sp_grp &g) {
    if (g.n > 1)
        cg::this_cluster().sync();
    else
        __syncthreads();
}

/* Block r's copy of *p (its shared memory, through the cluster's). */
template <typename T> __device__ __forceinline__ T sp_at(T *p, const sp_grp &g, int r) {
    return g.n > 1 ? *cg::this_cluster().map_shared_rank(p, r) : *p;
}

/* A float's bits as an unsigned that orders like the float (NaN as -inf). */
__device__ __forceinline__ unsigned sp_key(float v) {
    if (isnan(v))
        v = -INFINITY;
    unsigned b = __float_as_uint(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

/* The sum over the cluster of every thread's v (the same in every thread). */
__device__ double sp_sum_d(sp_smem *sm, sp_grp &g, double v) {
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if ((threadIdx.x & 31) == 0)
        sm->d[threadIdx.x >> 5] = v;
    __syncthreads();
    double t = 0.0;
    for (int w = 0; w < g.nw; w++)
        t += sm->d[w];
    if (g.n > 1) {
        if (threadIdx.x == 0)
            sm->xd[g.par] = t;
        sp_gsync(g);
        t = 0.0;
        for (int r = 0; r < g.n; r++)
            t += sp_at(&sm->xd[g.par], g, r);
        g.par ^= 1;
    }
    return t;
}

__device__ float sp_max_f(sp_smem *sm, sp_grp &g, float v) {
    for (int o = 16; o > 0; o >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();
    if ((threadIdx.x & 31) == 0)
        sm->f[threadIdx.x >> 5] = v;
    __syncthreads();
    float t = -INFINITY;
    for (int w = 0; w < g.nw; w++)
        t = fmaxf(t, sm->f[w]);
    if (g.n > 1) {
        if (threadIdx.x == 0)
            sm->xf[g.par] = t;
        sp_gsync(g);
        for (int r = 0; r < g.n; r++)
            t = fmaxf(t, sp_at(&sm->xf[g.par], g, r));
        g.par ^= 1;
    }
    return t;
}

/* Whether candidate (ov, oi) beats (bv, bi): the larger value, ties to the
 * lower id (id -1: none; NaN never wins, as `>` from -inf). */
__device__ __forceinline__ bool sp_better(float ov, int oi, float bv, int bi) {
    return oi >= 0 && (bi < 0 || ov > bv || (ov == bv && oi < bi));
}

/* The lowest id holding the largest value among the cluster's candidates
 * (one a thread; id -1: none). */
__device__ int sp_argmax(sp_smem *sm, sp_grp &g, float v, int id) {
    float bv = v;
    int bi = id;
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        const bool take = sp_better(ov, oi, bv, bi);
        bv = take ? ov : bv;
        bi = take ? oi : bi;
    }
    __syncthreads();
    if ((threadIdx.x & 31) == 0) {
        sm->f[threadIdx.x >> 5] = bv;
        sm->i[threadIdx.x >> 5] = bi;
    }
    __syncthreads();
    float rv = -INFINITY;
    int ri = -1;
    for (int w = 0; w < g.nw; w++)
        if (sp_better(sm->f[w], sm->i[w], rv, ri)) {
            rv = sm->f[w];
            ri = sm->i[w];
        }
    if (g.n > 1) {
        if (threadIdx.x == 0) {
            sm->xf[g.par] = rv;
            sm->xi[g.par] = ri;
        }
        sp_gsync(g);
        for (int r = 0; r < g.n; r++) {
            const float ov = sp_at(&sm->xf[g.par], g, r);
            const int oi = sp_at(&sm->xi[g.par], g, r);
            if (sp_better(ov, oi, rv, ri)) {
                rv = ov;
                ri = oi;
            }
        }
        g.par ^= 1;
    }
    return ri;
}

/* Which ids a thread visits: the row is cut into runs of seg ids (a
 * multiple of 32), one for each warp of the cluster in rank order; lane l
 * of the warp with run [base, base + seg) visits base + 32k + l, so each
 * step of a warp reads 128 contiguous bytes, and in id order a warp's steps
 * come one after another, then the block's warps in order, then the
 * blocks in rank order. Passes that rank ties or walk the row in id order
 * keep their loops warp-uniform (steps, with `valid` for ids past the row)
 * and count within a step by ballot. */
struct sp_layout {
    int base, end, steps, lane;
    __device__ __forceinline__ int first() const {
        return base + lane;
    }
};

__device__ __forceinline__ sp_layout sp_layout_of(int vocab, const sp_grp &g) {
    const int runs = g.nw * g.n;
    const int seg = ((vocab + runs - 1) / runs + 31) / 32 * 32;
    sp_layout L;
    L.lane = threadIdx.x & 31;
    L.base = min((g.rank * g.nw + (int)(threadIdx.x >> 5)) * seg, vocab);
    L.end = min(L.base + seg, vocab);
    L.steps = seg / 32;
    return L;
}

/* Inclusive prefix over the lanes of a warp (every lane calls it). */
__device__ __forceinline__ double sp_warp_scan_d(double v) {
    const int lane = threadIdx.x & 31;
    for (int o = 1; o < 32; o <<= 1) {
        const double y = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o)
            v += y;
    }
    return v;
}

/* Exclusive prefix in id order of a warp-uniform value (an int count or a
 * double mass), and the cluster's total: the warps before this one in its
 * block in order, then the blocks before this one in rank order (every
 * thread calls it; lane 0 of each warp publishes). */
template <typename T> __device__ void sp_scan(sp_smem *sm, sp_grp &g, T mine, T *before, T *total) {
    T *part, *slot; /* a warp's values, this block's part of the exchange */
    if constexpr (std::is_same<T, double>::value) {
        part = sm->d;
        slot = &sm->xd[g.par];
    } else {
        part = sm->i;
        slot = &sm->xi[g.par];
    }
    __syncthreads();
    if ((threadIdx.x & 31) == 0)
        part[threadIdx.x >> 5] = mine;
    __syncthreads();
    T b = T(0), t = T(0);
    for (int w = 0; w < g.nw; w++) {
        b += w < (int)(threadIdx.x >> 5) ? part[w] : T(0);
        t += part[w];
    }
    if (g.n > 1) {
        if (threadIdx.x == 0)
            *slot = t;
        sp_gsync(g);
        T rb = T(0);
        t = T(0);
        for (int r = 0; r < g.n; r++) {
            const T x = sp_at(slot, g, r);
            rb += r < g.rank ? x : T(0);
            t += x;
        }
        b = rb + b;
        g.par ^= 1;
    }
    *before = b;
    *total = t;
}

/* The ties (a count) before this warp's run in id order. */
__device__ int sp_before_i(sp_smem *sm, sp_grp &g, int mine) {
    int before, total;
    sp_scan(sm, g, mine, &before, &total);
    return before;
}

/* A thread's adds into a shared histogram go through four bins it keeps
 * in registers: a row's values fall in a handful of a digit's 256 bins (its
 * weights' or logits' exponents), so one atomic per value would queue the
 * whole block on those few addresses (top-p took 0.6 ms a row that way). A
 * value whose bin is not held evicts one (round robin) into the histogram;
 * flush() adds what is left. */
template <typename T> struct sp_bins {
    int d[4];
    T v[4];
    int next;
    __device__ __forceinline__ void init() {
        d[0] = d[1] = d[2] = d[3] = -1;
        v[0] = v[1] = v[2] = v[3] = T(0);
        next = 0;
    }
    __device__ __forceinline__ void add(T *hist, int bin, T x) {
#pragma unroll
        for (int j = 0; j < 4; j++)
            if (d[j] == bin) {
                v[j] += x;
                return;
            }
#pragma unroll
        for (int j = 0; j < 4; j++)
            if (j == next) {
                if (d[j] >= 0)
                    atomicAdd(&hist[d[j]], v[j]);
                d[j] = bin;
                v[j] = x;
            }
        next = (next + 1) & 3;
    }
    __device__ __forceinline__ void flush(T *hist) {
#pragma unroll
        for (int j = 0; j < 4; j++)
            if (d[j] >= 0)
                atomicAdd(&hist[d[j]], v[j]);
    }
};

/* The cluster's histogram: each block's (local, slot g.par, complete)
 * added up bin by bin in rank order into sum. */
template <typename T> __device__ void sp_hist_total(sp_grp &g, T *local, T *sum) {
    sp_gsync(g);
    for (int d = threadIdx.x; d < 256; d += blockDim.x) {
        T t = T(0);
        for (int r = 0; r < g.n; r++)
            t += sp_at(&local[d], g, r);
        sum[d] = t;
    }
    __syncthreads();
    g.par ^= 1;
}

/* Radix selection by counts: the key of the k-th largest among the ids for
 * which key_of gives a value (all ids here), and how many ids at that key to
 * keep. KEY(i) is evaluated per id; every thread calls it. */
template <typename KeyF>
__device__ void sp_select_count(sp_smem *sm, sp_grp &g, const sp_layout &L, int k, KeyF key_of, unsigned *tau,
                                int *rest) {
    unsigned prefix = 0, mask = 0;
    int want = k;
    for (int shift = 24; shift >= 0; shift -= 8) {
        unsigned *hist = sm->hist[g.par];
        for (int d = threadIdx.x; d < 256; d += blockDim.x)
            hist[d] = 0;
        __syncthreads();
        sp_bins<unsigned> bins;
        bins.init();
        for (int i = L.first(); i < L.end; i += 32) {
            const unsigned key = key_of(i);
            if ((key & mask) == prefix)
                bins.add(hist, (int)((key >> shift) & 255u), 1u);
        }
        bins.flush(hist);
        __syncthreads();
        sp_hist_total(g, hist, sm->hsum);
        if (threadIdx.x == 0) {
            int cum = 0, d = 255;
            for (; d > 0 && cum + (int)sm->hsum[d] < want; d--)
                cum += (int)sm->hsum[d];
            sm->sel_prefix = prefix | ((unsigned)d << shift);
            sm->sel_rest = want - cum;
        }
        __syncthreads();
        prefix = sm->sel_prefix;
        want = sm->sel_rest;
        mask |= 255u << shift;
        __syncthreads();
    }
    *tau = prefix;
    *rest = want;
}

/* Per-pass view of one row: the logits l (steps 1-4 already written), the
 * temperature and the thresholds chosen so far. sp_keep_kp() says whether
 * an id survives top-k and top-p; every lane of a warp calls it at the same
 * step (valid false past the row), and it ranks ties in id order by
 * ballot, so the seen counters are the same in every lane of the warp. */
typedef struct {
    const float *l;
    float t, max; /* l / t, as model/sampler.c divides (not a reciprocal) */
    /* wc (or NULL): expf(l / t - max) of every id this thread visits, kept
     * from the pass after the max so that the passes of steps 7-9 read the
     * weights instead of dividing and calling expf again (the same values) */
    float *wc;
    /* top-k: key > k_tau, or key == k_tau among the first k_rest such */
    bool k_on;
    unsigned k_tau;
    int k_rest, k_seen; /* k_seen: ties at k_tau before this warp's next step */
    /* top-p on top-k's survivors: weight bits > p_tau, or == p_tau among the first p_rest */
    bool p_on;
    unsigned p_tau;
    int p_rest, p_seen;
} sp_view;

__device__ __forceinline__ float sp_scaled(const sp_view *v, int i) {
    float s = v->l[i] / v->t;
    return isnan(s) ? -INFINITY : s;
}

__device__ __forceinline__ bool sp_keep_kp(sp_view *v, int i, bool valid, float *w) {
    const unsigned lt = (1u << (threadIdx.x & 31)) - 1u;
    const float s = valid && (v->k_on || !v->wc) ? sp_scaled(v, i) : -INFINITY;
    bool ok = valid;
    if (v->k_on) {
        const unsigned key = sp_key(s);
        const bool tie = ok && key == v->k_tau;
        const unsigned bt = __ballot_sync(0xffffffffu, tie);
        ok = ok && (key > v->k_tau || (tie && v->k_seen + __popc(bt & lt) < v->k_rest));
        v->k_seen += __popc(bt);
    }
    *w = !ok ? 0.0f : v->wc ? v->wc[i] : expf(s - v->max);
    if (v->p_on) {
        const unsigned wb = __float_as_uint(*w);
        const bool tie = ok && wb == v->p_tau;
        const unsigned bt = __ballot_sync(0xffffffffu, tie);
        ok = ok && (wb > v->p_tau || (tie && v->p_seen + __popc(bt & lt) < v->p_rest));
        v->p_seen += __popc(bt);
    }
    return ok;
}

/* Step k of the draw (steps 8-9): whether this lane's id survives every
 * filter and min-p with a weight above 0, and in *inc the warp's inclusive
 * scan of those weights (the same additions whenever it is called again). */
__device__ __forceinline__ bool sp_draw_step(sp_view *v, const sp_layout &L, float min_p, int k, double *inc) {
    const int i = L.base + 32 * k + L.lane;
    float w;
    const bool ok = sp_keep_kp(v, i, i < L.end, &w) && w >= min_p && w > 0.0f;
    *inc = sp_warp_scan_d(ok ? (double)w : 0.0);
    return ok;
}

/* One row: steps 1-9 of pd_kernels.h's sample_rows, by the cluster of
 * gridDim.x / n_rows blocks that holds this block (launched without
 * clusters: one block a row). Rank 0 applies the listed tokens (steps 1, 3,
 * 4) and writes the row's results. */
template <bool CLUSTER>
static __global__ void __launch_bounds__(CLUSTER ? SP_CL_THREADS : SP_THREADS)
    k_sample(int vocab, float *logits, const pd_sample_row *__restrict__ rows, const pd_sample_tok *__restrict__ toks,
             float *raw_e, pd_sample_out *out, float *wcache) {
    __shared__ sp_smem sm;
    sp_grp g;
    g.n = CLUSTER ? (int)cg::this_cluster().num_blocks() : 1;
    g.rank = CLUSTER ? (int)cg::this_cluster().block_rank() : 0;
    g.par = 0;
    g.nw = (int)blockDim.x >> 5;
    const int row = (int)blockIdx.x / g.n;
    const bool lead = g.rank == 0;
    if (threadIdx.x == 0)
        sm.row = rows[row];
    __syncthreads();
    const pd_sample_row &R = sm.row;
    /* what is needed only at the start and the end is recomputed there
     * (R.tok_off, row) or kept in shared memory (lmax, lse, the argmax),
     * not held in registers through the passes */
    float *l = logits + (size_t)R.row * vocab;
    const int tid = threadIdx.x, lane = tid & 31;
    const unsigned lt = (1u << lane) - 1u;
    const sp_layout L = sp_layout_of(vocab, g);
    const bool past_vocab = R.n_vocab > 0 && R.n_vocab < vocab;

    /* 1. masks */
    if (lead)
        for (int e = tid; e < R.n_tok; e += blockDim.x)
            if (toks[R.tok_off + e].flags & PD_SAMPLE_MASKED)
                l[toks[R.tok_off + e].id] = -INFINITY;
    if (lead && tid == 0)
        sm.n_top = 0;
    sp_gsync(g);

    /* 2. logprobs of l as it stands: the normaliser, then the n_top best */
    float lmax = -INFINITY;
    double lse = 0.0;
    if (R.want_logprob || R.n_top > 0) {
        float m = -INFINITY;
        for (int i = L.first(); i < L.end; i += 32)
            m = l[i] > m ? l[i] : m;
        lmax = sp_max_f(&sm, g, m);
        double s = 0.0;
        if (lmax != -INFINITY)
            for (int i = L.first(); i < L.end; i += 32)
                s += exp((double)l[i] - (double)lmax);
        s = sp_sum_d(&sm, g, s);
        lse = lmax == -INFINITY ? 0.0 : log(s);
    }
    if (tid == 0) {
        sm.lmax = lmax;
        sm.lse = lse;
    }
    const int n_top = min(R.n_top, vocab);
    if (n_top > 0) {
        unsigned tau;
        int rest;
        sp_select_count(&sm, g, L, n_top, [&](int i) { return sp_key(l[i]); }, &tau, &rest);
        /* ties at tau before this warp's run, then the picks in id order,
         * into rank 0's list */
        int mine = 0;
        for (int k = 0; k < L.steps; k++) {
            const int i = L.base + 32 * k + lane;
            mine += __popc(__ballot_sync(0xffffffffu, i < L.end && sp_key(l[i]) == tau));
        }
        int seen = sp_before_i(&sm, g, mine);
        int *n_picked = g.n > 1 ? cg::this_cluster().map_shared_rank(&sm.n_top, 0) : &sm.n_top;
        int *top_id = g.n > 1 ? cg::this_cluster().map_shared_rank(sm.top_id, 0) : sm.top_id;
        float *top_l = g.n > 1 ? cg::this_cluster().map_shared_rank(sm.top_l, 0) : sm.top_l;
        for (int k = 0; k < L.steps; k++) {
            const int i = L.base + 32 * k + lane;
            const unsigned key = i < L.end ? sp_key(l[i]) : 0u;
            const bool tie = i < L.end && key == tau;
            const unsigned bt = __ballot_sync(0xffffffffu, tie);
            if (i < L.end && (key > tau || (tie && seen + __popc(bt & lt) < rest))) {
                const int slot = atomicAdd(n_picked, 1);
                top_id[slot] = i;
                top_l[slot] = l[i];
            }
            seen += __popc(bt);
        }
        sp_gsync(g);
        if (lead && tid == 0) { /* best first, ties to the lower id */
            const int n = sm.n_top;
            for (int a = 1; a < n; a++) {
                int id = sm.top_id[a];
                float v = sm.top_l[a];
                int b = a;
                for (; b > 0 && (sp_key(v) > sp_key(sm.top_l[b - 1]) ||
                                 (sp_key(v) == sp_key(sm.top_l[b - 1]) && id < sm.top_id[b - 1]));
                     b--) {
                    sm.top_id[b] = sm.top_id[b - 1];
                    sm.top_l[b] = sm.top_l[b - 1];
                }
                sm.top_id[b] = id;
                sm.top_l[b] = v;
            }
            pd_sample_out *o = out + row;
            o->n_top = n;
            for (int a = 0; a < n; a++) {
                o->top_ids[a] = sm.top_id[a];
                o->top_logprobs[a] = lmax == -INFINITY ? -INFINITY
                                                       : (float)((double)sm.top_l[a] - (double)lmax - lse);
            }
        }
    } else if (lead && tid == 0) {
        out[row].n_top = 0;
    }
    /* every block has read l for step 2 before rank 0 rewrites it */
    if (g.n > 1 && (R.n_tok > 0 || past_vocab))
        sp_gsync(g);
    else
        __syncthreads();

    /* 3, 4. logit_bias and penalties on the listed tokens (their raw
     * logits kept for the sampled token's logprob) */
    if (lead)
        for (int e = tid; e < R.n_tok; e += blockDim.x) {
            const pd_sample_tok t = toks[R.tok_off + e];
            float v = l[t.id];
            raw_e[R.tok_off + e] = v;
            v += t.bias;
            if ((t.flags & PD_SAMPLE_SEEN) && R.repetition_penalty != 1.0f)
                v = v > 0.0f ? v / R.repetition_penalty : v * R.repetition_penalty;
            if (t.count > 0) {
                v -= R.frequency_penalty * (float)t.count;
                v -= R.presence_penalty;
            }
            l[t.id] = v;
        }
    /* 4b. ids past n_vocab (no text) are never drawn, whatever steps 3-4
     * gave them (a cluster's other blocks write them: after rank 0's) */
    if (R.n_tok > 0 && past_vocab) /* (one block: other threads' writes of steps 3-4) */
        sp_gsync(g);
    if (past_vocab)
        for (int i = R.n_vocab + g.rank * (int)blockDim.x + tid; i < vocab; i += g.n * (int)blockDim.x)
            l[i] = -INFINITY;
    if (g.n > 1 && (R.n_tok > 0 || past_vocab))
        sp_gsync(g);
    else
        __syncthreads();

    /* 5. greedy, or the scaled logits' max */
    int token = -1;
    if (R.temperature < SP_EPS) {
        float bv = -INFINITY;
        int bi = -1;
        for (int i = L.first(); i < L.end; i += 32)
            if (l[i] > bv) {
                bv = l[i];
                bi = i;
            }
        token = sp_argmax(&sm, g, bv, bi);
        token = token < 0 ? 0 : token;
    } else {
        sp_view v = {};
        v.l = l;
        v.t = R.temperature;
        float m = -INFINITY;
        for (int i = L.first(); i < L.end; i += 32)
            m = fmaxf(m, sp_scaled(&v, i));
        v.max = sp_max_f(&sm, g, m);
        float bv = -INFINITY; /* the argmax of the scaled logits: steps 5 and 9's fallback */
        int bi = -1;
        float *wc = wcache ? wcache + (size_t)row * vocab : NULL; /* row r's: each thread its own ids */
        for (int i = L.first(); i < L.end; i += 32) {
            const float sc = sp_scaled(&v, i);
            if (sc > bv) {
                bv = sc;
                bi = i;
            }
            if (wc) /* read only where v.max is finite (below) */
                wc[i] = expf(sc - v.max);
        }
        v.wc = wc;
        const int amax = sp_argmax(&sm, g, bv, bi);
        if (tid == 0)
            sm.amax = amax;
        if (!isfinite(v.max)) {
            token = amax < 0 ? 0 : amax;
        } else {
            /* 6. top-k */
            int k_seen0 = 0;
            if (R.top_k > 0 && R.top_k < vocab) {
                int rest;
                sp_select_count(&sm, g, L, R.top_k, [&](int i) { return sp_key(sp_scaled(&v, i)); }, &v.k_tau,
                                &rest);
                v.k_rest = rest;
                int mine = 0;
                for (int k = 0; k < L.steps; k++) {
                    const int i = L.base + 32 * k + lane;
                    mine += __popc(__ballot_sync(0xffffffffu, i < L.end && sp_key(sp_scaled(&v, i)) == v.k_tau));
                }
                k_seen0 = sp_before_i(&sm, g, mine);
                v.k_on = true;
            }
            /* 7. top-p over top-k's survivors, by mass */
            int p_seen0 = 0;
            if (R.top_p < 1.0f) {
                double s = 0.0;
                v.k_seen = k_seen0;
                for (int k = 0; k < L.steps; k++) {
                    const int i = L.base + 32 * k + lane;
                    float w;
                    if (sp_keep_kp(&v, i, i < L.end, &w))
                        s += w;
                }
                const double total = sp_sum_d(&sm, g, s);
                double need = (double)R.top_p * total;
                unsigned prefix = 0, mask = 0;
                bool all_kept = false;
                for (int shift = 24; shift >= 0 && !all_kept; shift -= 8) {
                    double *mass = sm.mass[g.par];
                    for (int d = tid; d < 256; d += blockDim.x)
                        mass[d] = 0.0;
                    __syncthreads();
                    v.k_seen = k_seen0;
                    sp_bins<double> bins;
                    bins.init();
                    for (int k = 0; k < L.steps; k++) {
                        const int i = L.base + 32 * k + lane;
                        float w;
                        if (sp_keep_kp(&v, i, i < L.end, &w)) {
                            const unsigned wb = __float_as_uint(w);
                            if ((wb & mask) == prefix)
                                bins.add(mass, (int)((wb >> shift) & 255u), (double)w);
                        }
                    }
                    bins.flush(mass);
                    __syncthreads();
                    sp_hist_total(g, mass, sm.msum);
                    if (tid == 0) {
                        double cum = 0.0;
                        int d = 255;
                        for (; d >= 0 && cum + sm.msum[d] < need; d--)
                            cum += sm.msum[d];
                        sm.sel_all = 0;
                        if (d < 0 && shift == 24) {
                            sm.sel_all = 1; /* rounding kept need out of reach: keep them all */
                        } else if (d < 0) {
                            /* this pass's sums fell short of the last pass's by
                             * rounding: the lightest digit that has mass, all of it */
                            for (d = 0; d < 255 && sm.msum[d] == 0.0; d++)
                                ;
                            cum = need - sm.msum[d];
                        }
                        sm.sel_prefix = prefix | ((unsigned)max(d, 0) << shift);
                        sm.sel_need = need - cum;
                    }
                    __syncthreads();
                    all_kept = sm.sel_all;
                    prefix = sm.sel_prefix;
                    need = sm.sel_need;
                    mask |= 255u << shift;
                    __syncthreads();
                }
                if (!all_kept) {
                    /* the ties at the threshold weight, lowest ids first, until need is met */
                    const float wt = __uint_as_float(prefix);
                    int rest = 0;
                    for (double acc = 0.0; acc < need && wt > 0.0f && rest < vocab; rest++)
                        acc += (double)wt;
                    rest = max(rest, 1);
                    int mine = 0;
                    v.k_seen = k_seen0;
                    for (int k = 0; k < L.steps; k++) {
                        const int i = L.base + 32 * k + lane;
                        float w;
                        const bool kept = sp_keep_kp(&v, i, i < L.end, &w);
                        mine += __popc(__ballot_sync(0xffffffffu, kept && __float_as_uint(w) == prefix));
                    }
                    p_seen0 = sp_before_i(&sm, g, mine);
                    v.p_on = true;
                    v.p_tau = prefix;
                    v.p_rest = rest;
                }
            }
            /* 8, 9. min-p, then the draw in id order: each warp's mass of
             * survivors summed step by step (a warp scan a step), the
             * masses before it in id order (warps, then blocks), and the
             * warp whose run holds u times the total walks it again with
             * the same additions */
            double S = 0.0;
            int last = -1;
            v.k_seen = k_seen0;
            v.p_seen = p_seen0;
            for (int k = 0; k < L.steps; k++) {
                double inc;
                const bool ok = sp_draw_step(&v, L, R.min_p, k, &inc);
                S += __shfl_sync(0xffffffffu, inc, 31);
                if (ok)
                    last = L.base + 32 * k + lane;
            }
            double before, total;
            sp_scan(&sm, g, S, &before, &total);
            const double target = R.u * total;
            const double rem = target - before;
            if (tid == 0)
                sm.found = -1;
            __syncthreads();
            if (rem >= 0.0 && rem < S) { /* warp-uniform */
                double cum = 0.0;
                v.k_seen = k_seen0;
                v.p_seen = p_seen0;
                for (int k = 0; k < L.steps; k++) {
                    double inc;
                    const bool ok = sp_draw_step(&v, L, R.min_p, k, &inc);
                    const unsigned hit = __ballot_sync(0xffffffffu, ok && cum + inc > rem);
                    if (hit) {
                        if (lane == 0)
                            atomicMin((unsigned *)&sm.found, (unsigned)(L.base + 32 * k + (__ffs(hit) - 1)));
                        break;
                    }
                    cum += __shfl_sync(0xffffffffu, inc, 31);
                }
            }
            /* the token (-1: none crossed) and the last survivor, over the cluster */
            for (int o2 = 16; o2 > 0; o2 >>= 1)
                last = max(last, __shfl_xor_sync(0xffffffffu, last, o2));
            __syncthreads();
            const int found = sm.found; /* -1 as unsigned: the largest, so atomicMin keeps a hit */
            if (lane == 0)
                sm.i[tid >> 5] = last;
            __syncthreads();
            int lst = -1;
            for (int w = 0; w < g.nw; w++)
                lst = max(lst, sm.i[w]);
            token = found;
            if (g.n > 1) {
                if (tid == 0) {
                    sm.xi[g.par] = found;
                    sm.xi2[g.par] = lst;
                }
                sp_gsync(g);
                token = -1;
                for (int r = 0; r < g.n; r++) {
                    const int f = sp_at(&sm.xi[g.par], g, r);
                    token = token < 0 ? f : token;
                    lst = max(lst, sp_at(&sm.xi2[g.par], g, r));
                }
                g.par ^= 1;
            }
            if (token < 0) /* none crossed: the last survivor, else the argmax */
                token = lst >= 0 ? lst : (sm.amax < 0 ? 0 : sm.amax);
        }
    }

    /* the sampled token's logprob, from its logit before steps 3-4 */
    if (lead) {
        pd_sample_out *o = out + row;
        if (R.want_logprob) {
            if (tid == 0)
                sm.chosen_entry = -1;
            __syncthreads();
            for (int e = tid; e < R.n_tok; e += blockDim.x)
                if (toks[R.tok_off + e].id == token)
                    sm.chosen_entry = e;
            __syncthreads();
            if (tid == 0) {
                const float raw = sm.chosen_entry >= 0 ? raw_e[R.tok_off + sm.chosen_entry] : l[token];
                o->logprob = sm.lmax == -INFINITY ? -INFINITY : (float)((double)raw - (double)sm.lmax - sm.lse);
            }
        } else if (tid == 0) {
            o->logprob = 0.0f;
        }
        if (tid == 0)
            o->token = token;
    }
    /* no block leaves while another may still read its shared memory */
    if (g.n > 1)
        cg::this_cluster().sync();
}

/* ---- greedy rows with nothing else asked: the argmax over many blocks ----
 *
 * k_sample gives a row one block: its greedy pass alone reads a V2-Lite row
 * (129280 logits, 517 KB) through one SM, and a decode step at batch 1 that
 * samples on the device took ~20 µs longer than one that downloaded the
 * whole row instead (session 18, bench_step --outputs). Here block (s, r)
 * takes slice s of row r's ids below its end (n_vocab, else vocab), eight
 * loads in flight a thread, and writes its best (value, id); the host adds
 * up the slices. The same token as k_sample's step 5: the largest logit,
 * ties to the lower id, NaN never taken, id 0 when every logit is -inf or
 * NaN; and the ids from the end on are set to -inf, as step 4b does. The
 * rows come in the launch's parameters and the slices' bests go straight
 * into page-locked host memory (with unified addressing a kernel may store
 * to cudaHostAlloc's memory through the same pointer), so nothing waits
 * on a copy engine: an upload after the graph and a download after the
 * kernel each cost 3-7 µs of the step (session 18's timeline). */
#define SPG_THREADS 256
#define SPG_U 8          /* loads in flight a thread */
#define SPG_MAX_SLICES 128
#define SPG_ROWS 128 /* rows a launch (in its parameters: 1 KB) */

typedef struct {
    int2 re[SPG_ROWS]; /* {logits row, end} */
} spg_rows;

typedef struct {
    float v;
    int id; /* -1: the slice saw nothing larger than -inf */
} spg_best;

/* rows.re[r] = {logits row, end}; best[r · S + s], host memory */
static __global__ void __launch_bounds__(SPG_THREADS)
    k_argmax_slices(int vocab, float *logits, const __grid_constant__ spg_rows rows, spg_best *best) {
    __shared__ float sv[SPG_THREADS / 32];
    __shared__ int si[SPG_THREADS / 32];
    const int S = gridDim.x, s = blockIdx.x, r = blockIdx.y, tid = threadIdx.x;
    const int2 q = rows.re[r];
    float *l = logits + (size_t)q.x * vocab;
    const int per = (q.y + S - 1) / S, i0 = s * per, i1 = min(q.y, i0 + per);
    const int tper = (vocab - q.y + S - 1) / S; /* step 4b: this block's share of the ids from the end on */
    for (int i = q.y + s * tper + tid; i < min(vocab, q.y + (s + 1) * tper); i += SPG_THREADS)
        l[i] = -INFINITY;
    float bv = -INFINITY;
    int bi = -1;
    for (int base = i0; base < i1; base += SPG_THREADS * SPG_U) {
        float v[SPG_U];
#pragma unroll
        for (int u = 0; u < SPG_U; u++) {
            const int i = base + u * SPG_THREADS + tid;
            v[u] = i < i1 ? l[i] : -INFINITY;
        }
#pragma unroll
        for (int u = 0; u < SPG_U; u++) /* ids rising: > keeps the lower id of equals */
            if (v[u] > bv) {
                bv = v[u];
                bi = base + u * SPG_THREADS + tid;
            }
    }
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (sp_better(ov, oi, bv, bi)) {
            bv = ov;
            bi = oi;
        }
    }
    if ((tid & 31) == 0) {
        sv[tid >> 5] = bv;
        si[tid >> 5] = bi;
    }
    __syncthreads();
    if (tid == 0) {
        for (int w = 1; w < SPG_THREADS / 32; w++)
            if (sp_better(sv[w], si[w], bv, bi)) {
                bv = sv[w];
                bi = si[w];
            }
        best[(size_t)r * S + s] = spg_best{bv, bi};
    }
}

/* A launch of k_sample<true> over grid blocks in clusters of cl (at: its
 * one attribute, the caller's). */
static cudaLaunchConfig_t sp_cluster_config(cudaLaunchAttribute *at, int cl, unsigned grid, cudaStream_t s) {
    cudaLaunchConfig_t cfg = {};
    at->id = cudaLaunchAttributeClusterDimension;
    at->val.clusterDim.x = (unsigned)cl;
    at->val.clusterDim.y = 1;
    at->val.clusterDim.z = 1;
    cfg.gridDim = dim3(grid);
    cfg.blockDim = dim3(SP_CL_THREADS);
    cfg.stream = s;
    cfg.attrs = at;
    cfg.numAttrs = 1;
    return cfg;
}

/* k_sample's blocks a row (a cluster): the most, up to the device's
 * largest cluster of such blocks (16 where a GPC holds 16 of them, else 8),
 * such that the batch's clusters all run at once (as many as the device
 * says it can hold of that size, and n · size blocks at most one a SM)
 * and each block has SP_CL_IDS ids or more; PD_SAMPLE_CLUSTER's size where
 * set (at most the device's largest). Sizes the device refuses are
 * skipped, down to 1. */
static int sp_cluster_size(cu_ctx *c, int n, int vocab) {
    if (c->sample_cl_max == 0) {
        int best = 1;
        for (int cl = SP_CL_MAX, k = 4; cl > 1; cl /= 2, k--) {
            c->sample_cl_fit[k] = 0;
            if (cl > 8 && cudaFuncSetAttribute(k_sample<true>, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) !=
                              cudaSuccess) {
                cudaGetLastError();
                continue;
            }
            cudaLaunchAttribute at;
            const cudaLaunchConfig_t cfg = sp_cluster_config(&at, cl, (unsigned)cl, 0);
            int n_cl = 0;
            if (cudaOccupancyMaxActiveClusters(&n_cl, k_sample<true>, &cfg) == cudaSuccess && n_cl > 0) {
                c->sample_cl_fit[k] = n_cl;
                best = best > cl ? best : cl;
            } else {
                cudaGetLastError(); /* a size the device refuses: the next smaller one */
            }
        }
        c->sample_cl_max = best;
    }
    if (c->sample_cl_force)
        return c->sample_cl_force < c->sample_cl_max ? c->sample_cl_force : c->sample_cl_max;
    int cl = c->sample_cl_max, k = 0;
    while ((1 << k) < cl)
        k++;
    for (; cl > 1 && ((long)n * cl > c->n_sm || n > c->sample_cl_fit[k] || vocab / cl < SP_CL_IDS); k--)
        cl /= 2;
    return cl;
}

/* Section sizes in the one scratch buffer, 256-byte aligned. */
static size_t sp_round(size_t b) {
    return (b + 255) & ~(size_t)255;
}

void cu_sample_rows(pd_backend *be, int n, int vocab, float *logits, const pd_sample_row *rows,
                    const pd_sample_tok *toks, int n_toks, pd_sample_out *out) {
    cu_ctx *c = cu_of(be);
    for (int r = 0; r < n && out; r++) /* what a failed call leaves: no token */
        out[r].token = -1;
    if (c->status != PD_OK || n == 0)
        return;
    if (n < 0 || vocab <= 0 || !logits || !rows || !out || n_toks < 0 || (n_toks > 0 && !toks)) {
        cu_fail(c, PD_ERR_INVALID, "sample_rows: %d rows, vocab %d, %d listed tokens", n, vocab, n_toks);
        return;
    }
    for (int r = 0; r < n; r++) {
        const pd_sample_row *R = &rows[r];
        if (R->row < 0 || R->n_top < 0 || R->n_top > PD_SAMPLE_MAX_TOP || R->tok_off < 0 || R->n_tok < 0 ||
            R->tok_off > n_toks || R->n_tok > n_toks - R->tok_off) {
            cu_fail(c, PD_ERR_INVALID, "sample_rows: row %d (logits row %d, n_top %d, tokens [%d, +%d) of %d)", r,
                    R->row, R->n_top, R->tok_off, R->n_tok, n_toks);
            return;
        }
        for (int e = R->tok_off; e < R->tok_off + R->n_tok; e++)
            if (toks[e].id < 0 || toks[e].id >= vocab) {
                cu_fail(c, PD_ERR_INVALID, "sample_rows: row %d lists token %d outside the vocabulary (%d)", r,
                        (int)toks[e].id, vocab);
                return;
            }
    }
    if (c->capturing) {
        cu_fail(c, PD_ERR_UNSUPPORTED, "sample_rows: not while recording a graph (it waits for its results)");
        return;
    }
    bool plain_greedy = !c->sample_generic && c->uva;
    for (int r = 0; r < n && plain_greedy; r++)
        plain_greedy = rows[r].temperature < SP_EPS && rows[r].n_top == 0 && !rows[r].want_logprob &&
                       rows[r].n_tok == 0;
    if (plain_greedy) {
        int S = (vocab + SPG_THREADS * SPG_U - 1) / (SPG_THREADS * SPG_U);
        S = S < 1 ? 1 : S > SPG_MAX_SLICES ? SPG_MAX_SLICES : S;
        spg_best *h_best = (spg_best *)cu_host_scratch(c, CU_HSCR_SAMPLE, (size_t)n * S * sizeof(spg_best));
        if (!h_best)
            return;
        for (int r0 = 0; r0 < n; r0 += SPG_ROWS) {
            const int nr = n - r0 < SPG_ROWS ? n - r0 : SPG_ROWS;
            spg_rows q;
            for (int r = 0; r < nr; r++) {
                const pd_sample_row *R = &rows[r0 + r];
                q.re[r] = make_int2(R->row, R->n_vocab > 0 && R->n_vocab < vocab ? R->n_vocab : vocab);
            }
            k_argmax_slices<<<dim3((unsigned)S, (unsigned)nr), SPG_THREADS, 0, c->stream>>>(vocab, logits, q,
                                                                                          h_best + (size_t)r0 * S);
            if (!CU_LAUNCHED(c, cudaGetLastError(), "sample_rows (greedy)")) {
                cudaStreamSynchronize(c->stream); /* the chunks launched must not write h_best after the call */
                return;
            }
        }
        if (!CU_OK(c, cudaStreamSynchronize(c->stream)))
            return;
        for (int r = 0; r < n; r++) {
            float bv = -INFINITY;
            int bi = -1;
            for (int s = 0; s < S; s++) { /* slices in id order: > keeps the lower id of equals */
                const spg_best b = h_best[(size_t)r * S + s];
                if (b.id >= 0 && (bi < 0 || b.v > bv)) {
                    bv = b.v;
                    bi = b.id;
                }
            }
            out[r].token = bi < 0 ? 0 : bi;
            out[r].logprob = 0.0f;
            out[r].n_top = 0;
        }
        return;
    }
    const size_t b_rows = sp_round((size_t)n * sizeof *rows), b_toks = sp_round((size_t)n_toks * sizeof *toks);
    const size_t b_raw = sp_round((size_t)n_toks * sizeof(float)), b_out = sp_round((size_t)n * sizeof *out);
    /* the weights kept between passes (sp_view.wc): rows that draw, up to SP_WCACHE_MAX bytes in all */
    bool draws = false;
    for (int r = 0; r < n && !draws; r++)
        draws = rows[r].temperature >= SP_EPS;
    const size_t b_wc = draws && !c->sample_wc_off && (size_t)n * vocab * sizeof(float) <= SP_WCACHE_MAX
                            ? sp_round((size_t)n * vocab * sizeof(float))
                            : 0;
    char *d = (char *)cu_scratch(c, CU_SCR_SAMPLE, b_rows + b_toks + b_raw + b_out + b_wc);
    if (!d)
        return;
    pd_sample_row *d_rows = (pd_sample_row *)d;
    pd_sample_tok *d_toks = (pd_sample_tok *)(d + b_rows);
    float *d_raw = (float *)(d + b_rows + b_toks);
    pd_sample_out *d_out = (pd_sample_out *)(d + b_rows + b_toks + b_raw);
    /* with unified addressing (c->uva; PD_SAMPLE_GREEDY_FAST=0 keeps the
     * first version's copies, for A/B runs): rows and tokens go up from
     * page-locked staging (no wait on the host's side) and k_sample stores
     * its results straight into page-locked memory (no copy engine after
     * it), as k_argmax_slices does */
    char *hs = NULL;
    if (c->uva && !c->sample_generic &&
        (hs = (char *)cu_host_scratch(c, CU_HSCR_SAMPLE, b_rows + b_toks + b_out)) != NULL) {
        memcpy(hs, rows, (size_t)n * sizeof *rows);
        if (n_toks > 0)
            memcpy(hs + b_rows, toks, (size_t)n_toks * sizeof *toks);
        rows = (const pd_sample_row *)hs;
        toks = (const pd_sample_tok *)(hs + b_rows);
    } else if (c->status != PD_OK) {
        return; /* cu_host_scratch failed */
    }
    /* on a failure after a copy from hs is queued: the stream drained before
     * returning, so that the next call may rewrite hs */
    if (!CU_OK(c, cudaMemcpyAsync(d_rows, rows, (size_t)n * sizeof *rows, cudaMemcpyHostToDevice, c->stream)))
        return;
    if (n_toks > 0 &&
        !CU_OK(c, cudaMemcpyAsync(d_toks, toks, (size_t)n_toks * sizeof *toks, cudaMemcpyHostToDevice, c->stream))) {
        cudaStreamSynchronize(c->stream);
        return;
    }
    pd_sample_out *h_out = hs ? (pd_sample_out *)(hs + b_rows + b_toks) : NULL;
    const int cl = sp_cluster_size(c, n, vocab);
    float *wc = b_wc ? (float *)(d + b_rows + b_toks + b_raw + b_out) : NULL;
    cudaError_t e;
    if (cl > 1) {
        cudaLaunchAttribute at;
        const cudaLaunchConfig_t cfg = sp_cluster_config(&at, cl, (unsigned)(n * cl), c->stream);
        e = cudaLaunchKernelEx(&cfg, k_sample<true>, vocab, logits, (const pd_sample_row *)d_rows,
                               (const pd_sample_tok *)d_toks, d_raw, h_out ? h_out : d_out, wc);
    } else {
        k_sample<false><<<n, SP_THREADS, 0, c->stream>>>(vocab, logits, d_rows, d_toks, d_raw, h_out ? h_out : d_out, wc);
        e = cudaGetLastError();
    }
    if (!CU_LAUNCHED(c, e, "sample_rows")) {
        cudaStreamSynchronize(c->stream);
        return;
    }
    if (h_out) {
        if (CU_OK(c, cudaStreamSynchronize(c->stream)))
            memcpy(out, h_out, (size_t)n * sizeof *out);
        return;
    }
    if (CU_OK(c, cudaMemcpyAsync(out, d_out, (size_t)n * sizeof *out, cudaMemcpyDeviceToHost, c->stream)))
        CU_OK(c, cudaStreamSynchronize(c->stream));
}
