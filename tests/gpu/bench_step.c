/* Decode step time of a whole model on the CUDA backend, against the copy
 * ceiling measured in the same run.
 *
 *   bench_step MODEL_DIR [--batches 1,8,32] [--contexts 1024,8192] [--steps 10] [--variants
 * all|fast] [--outputs pageable,pinned,sampled,top_p] [--tp N [--ep]]
 *
 * For every context L and batch B: B sequences whose first L tokens are in
 * the KV cache (random latents written straight into the cache: a decode
 * step's cost does not depend on how the cache was filled), then decode
 * steps of one new token per sequence through pd_model_forward, timed on
 * the host around the call (it returns after the logits have arrived), the
 * median of --steps after three warm-up steps. The context grows by one
 * token per step, from L again for each table row.
 *
 * --outputs says where a step's output goes, one table row each (default
 * pageable, the figures of every session before 18): pageable, every
 * row's logits downloaded into malloc'd memory (the driver stages them
 * through its own page-locked buffer and copies them on the CPU: ~40 µs for
 * V2-Lite's 517 KB row on the H200 host); pinned, into page-locked memory
 * (the backend's host_alloc), one DMA; sampled, every row sampled greedily
 * on the device and only the tokens downloaded (pd_model_forward_ex, as the
 * decode replica runs a step: decode/scheduler.c); top_p, the same at
 * temperature 0.7 and top-p 0.9 (a chat client's usual setting: the
 * general sampling kernel instead of the greedy one).
 *
 * Bytes a step must read (bf16 weights, fp32 cache): every attention and
 * norm weight, the dense MLPs, per MoE layer the router, the shared experts
 * and the distinct routed experts the batch routes to, the lm_head, and the
 * KV rows of every sequence. The distinct experts are the expectation under
 * uniform routing, E·(1 − (1 − k/E)^B) (random weights route nearly
 * uniformly); the ratio divides those bytes by the step time and the copy
 * bandwidth.
 *
 * Variants switch the backend's fast paths (pd_cuda_features) one at a
 * time, so each one's effect is measured in the same run: all on; no graphs;
 * no graphs and no skinny GEMM; and also no device MoE (ids back to the host
 * every layer, as the first CUDA version did).
 *
 * --tp N: the model sharded over GPUs 0..N-1 (pd_model_load_tp); bytes
 * and the ceiling stay one GPU's, so the ratio says how far N GPUs get
 * past one GPU's copy ceiling. Only rank 0's cache holds the random
 * latents (the others' hold zeros: the same work). --ep: with expert
 * parallelism (pd_model_load_parallel; each GPU holds E/N whole routed
 * experts instead of 1/N of each).
 *
 * Built by tests/gpu/build.sh, run by tests/gpu/run.sh on a GPU host. */
#include <cuda_profiler_api.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_util.h"
#include "cuda/pd_cuda.h"
#include "pd_model.h"

static uint64_t g_rs = 0x2545f4914f6cdd1dull;
static uint64_t rnd_u64(void) {
    return bench_rnd(&g_rs);
}

/* Bytes one decode step of B sequences at context L must read. */
static double step_bytes(const pd_model_config *c, int B, int L, double *weights_p, double *kv_p) {
    double H = c->hidden_size, nh = c->num_attention_heads, dn = c->qk_nope_head_dim,
           dr = c->qk_rope_head_dim;
    double dv = c->v_head_dim, kvr = c->kv_lora_rank;
    double attn = (c->q_lora_rank > 0 ? c->q_lora_rank * H + nh * (dn + dr) * c->q_lora_rank
                                      : nh * (dn + dr) * H) +
                  (kvr + dr) * H + nh * (dn + dv) * kvr + H * nh * dv;
    double E = c->n_routed_experts, k = c->num_experts_per_tok;
    double distinct = E > 0 ? E * (1.0 - pow(1.0 - k / E, B)) : 0;
    double w = 0;
    for (int l = 0; l < c->num_hidden_layers; l++) {
        w += attn;
        if (pd_config_layer_is_moe(c, l))
            w += E * H + 3.0 * c->moe_intermediate_size * c->n_shared_experts * H +
                 distinct * 3.0 * c->moe_intermediate_size * H;
        else
            w += 3.0 * c->intermediate_size * H;
    }
    w += (double)c->vocab_size * H + B * H;
    w *= 2.0; /* bf16 */
    double kv = (double)B * L * c->num_hidden_layers * (kvr + dr) * 4.0;
    *weights_p = w;
    *kv_p = kv;
    return w + kv;
}

typedef struct {
    const char *name;
    pd_cuda_features f;
} variant;

int main(int argc, char **argv) {
    const char *dir = NULL;
    int batches[16] = {1, 8, 32}, n_b = 3, ctxs[16] = {1024, 8192}, n_c = 2, steps = 10, tp = 1;
    bool all_variants = true, ep = false;
    enum { OUT_PAGEABLE, OUT_PINNED, OUT_SAMPLED, OUT_TOP_P };
    static const char *const out_names[] = {"logits to pageable memory", "logits to pinned memory",
                                            "sampled on the device", "sampled on the device, T 0.7, top-p 0.9"};
    int outs[4] = {OUT_PAGEABLE}, n_outs = 1;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--batches") && i + 1 < argc)
            n_b = parse_list(argv[++i], batches, 16);
        else if (!strcmp(argv[i], "--contexts") && i + 1 < argc)
            n_c = parse_list(argv[++i], ctxs, 16);
        else if (!strcmp(argv[i], "--steps") && i + 1 < argc)
            steps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--variants") && i + 1 < argc)
            all_variants = strcmp(argv[++i], "fast") != 0;
        else if (!strcmp(argv[i], "--tp") && i + 1 < argc)
            tp = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--ep"))
            ep = true;
        else if (!strcmp(argv[i], "--outputs") && i + 1 < argc) {
            n_outs = 0;
            for (char *tok = strtok(argv[++i], ","); tok; tok = strtok(NULL, ",")) {
                if (n_outs == 4) {
                    fprintf(stderr, "bench_step: --outputs: at most 4 entries\n");
                    return 2;
                }
                if (!strcmp(tok, "pageable"))
                    outs[n_outs++] = OUT_PAGEABLE;
                else if (!strcmp(tok, "pinned"))
                    outs[n_outs++] = OUT_PINNED;
                else if (!strcmp(tok, "sampled"))
                    outs[n_outs++] = OUT_SAMPLED;
                else if (!strcmp(tok, "top_p"))
                    outs[n_outs++] = OUT_TOP_P;
                else {
                    fprintf(stderr, "bench_step: --outputs: '%s' is not pageable, pinned, sampled or top_p\n", tok);
                    return 2;
                }
            }
        }
        else
            dir = argv[i];
    }
    if (!dir || steps < 1 || steps > 200 || tp < 1 || tp > PD_TP_MAX_RANKS || n_outs < 1) {
        fprintf(stderr,
                "usage: bench_step MODEL_DIR [--batches 1,8,32] [--contexts 1024,8192] [--steps N] "
                "[--variants all|fast] [--outputs pageable,pinned,sampled,top_p] [--tp N [--ep]]\n");
        return 2;
    }
    pd_err err = {{0}};
    pd_backend *bes[PD_TP_MAX_RANKS] = {0}, *be = NULL;
    if ((tp == 1 ? pd_backend_cuda_init_ex(0, PD_CUDA_WEIGHTS_BF16, &bes[0], &err)
                 : pd_backend_cuda_init_tp(tp, bes, &err)) != PD_OK) {
        fprintf(stderr, "bench_step: %s\n", err.msg);
        return 1;
    }
    be = bes[0];
    struct cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    time_t tnow = time(NULL);
    char date[32];
    strftime(date, sizeof date, "%Y-%m-%d", gmtime(&tnow));
    printf("# bench_step %s: %s, %d SMs; model %s; tensor parallel size %d%s\n\n", date, prop.name,
           prop.multiProcessorCount, dir, tp, ep ? ", expert parallel" : "");

    /* ceiling: a 1 GiB device-to-device copy, bytes read + written */
    size_t cb = (size_t)1 << 30;
    void *src, *dst;
    CK(cudaMalloc(&src, cb));
    CK(cudaMalloc(&dst, cb));
    CK(cudaMemset(src, 0x5a, cb));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    double tc[20];
    for (int i = 0; i < 23; i++) {
        CK(cudaEventRecord(e0, 0));
        CK(cudaMemcpyAsync(dst, src, cb, cudaMemcpyDeviceToDevice, 0));
        CK(cudaEventRecord(e1, 0));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (i >= 3)
            tc[i - 3] = ms * 1e-3;
    }
    qsort(tc, 20, sizeof tc[0], cmp_d);
    double bw = 2.0 * cb / tc[10];
    CK(cudaFree(src));
    CK(cudaFree(dst));
    printf("ceiling: device-to-device copy of 1 GiB: %.0f GB/s (read + written)\n", bw / 1e9);

    double t0 = now_s();
    pd_model *m = NULL;
    if (pd_model_load_parallel(dir, bes, tp, ep, &m, &err) != PD_OK) {
        fprintf(stderr, "bench_step: %s\n", err.msg);
        return 1;
    }
    pd_err e2 = {{0}};
    for (int r = 0; r < tp; r++)
        if (pd_backend_cuda_status(bes[r], &e2) != PD_OK) {
            fprintf(stderr, "bench_step: load, rank %d: %s\n", r, e2.msg);
            return 1;
        }
    const pd_model_config *c = pd_model_config_of(m);
    size_t free_b, total_b;
    CK(cudaMemGetInfo(&free_b, &total_b));
    printf("model loaded in %.1f s; %.1f GiB of %.1f GiB in use\n\n", now_s() - t0,
           (total_b - free_b) / 1073741824.0, total_b / 1073741824.0);

    static const variant vars[] = {
        {"graphs + skinny GEMM + device MoE", {true, true, true}},
        {"no graphs", {false, true, true}},
        {"no graphs, cuBLASLt for every GEMM", {false, false, true}},
        {"no graphs, cuBLASLt, MoE ids via host (first version's MoE)", {false, false, false}},
    };
    int n_var = all_variants ? 4 : 1;
    printf("| context | batch | variant | step ms (median) | min | tok/s | GB must read (weights + "
           "KV) | GB/s | of copy "
           "ceiling |\n|---|---|---|---|---|---|---|---|---|\n");
    fflush(stdout);
    const int bs = 16, V = c->vocab_size;
    float *logits = malloc((size_t)batches[0] * V * sizeof(float));
    int max_b = 0;
    for (int i = 0; i < n_b; i++)
        if (batches[i] > max_b)
            max_b = batches[i];
    logits = realloc(logits, (size_t)max_b * V * sizeof(float));
    float *logits_pinned = NULL;
    pd_sample_row *srows = calloc((size_t)max_b, sizeof *srows), *trows = calloc((size_t)max_b, sizeof *trows);
    pd_sample_out *sout = calloc((size_t)max_b, sizeof *sout);
    uint8_t *no_rows = calloc((size_t)max_b, 1); /* sampled: no row downloaded */
    for (int i = 0; i < n_outs; i++) {
        if (outs[i] == OUT_PINNED && !logits_pinned &&
            !(be->ops->host_alloc && (logits_pinned = be->ops->host_alloc(be, (size_t)max_b * V * sizeof(float))))) {
            fprintf(stderr, "bench_step: --outputs pinned: no page-locked memory\n");
            return 1;
        }
        if ((outs[i] == OUT_SAMPLED || outs[i] == OUT_TOP_P) && !pd_model_samples_on_device(m)) {
            fprintf(stderr, "bench_step: --outputs sampled / top_p: this model does not sample on the device\n");
            return 1;
        }
    }
    for (int r = 0; r < max_b; r++) /* greedy, nothing else on (sample_rows' meanings: pd_kernels.h) */
        srows[r] = (pd_sample_row){.row = r, .temperature = 0.0f, .top_p = 1.0f, .repetition_penalty = 1.0f,
                                   .u = 0.5};
    for (int r = 0; r < max_b; r++)
        trows[r] = (pd_sample_row){.row = r, .temperature = 0.7f, .top_p = 0.9f, .repetition_penalty = 1.0f,
                                   .u = (r + 0.5) / max_b};
    size_t chunk_bytes = (size_t)64 << 20;
    float *fill = malloc(chunk_bytes);
    for (size_t i = 0; i < chunk_bytes / 4;
         i++) /* roughly N(0,1): the sum of four uniforms, scaled */
        fill[i] = (float)(((double)(rnd_u64() >> 11) / 9007199254740992.0 +
                           (double)(rnd_u64() >> 11) / 9007199254740992.0 +
                           (double)(rnd_u64() >> 11) / 9007199254740992.0 +
                           (double)(rnd_u64() >> 11) / 9007199254740992.0 - 2.0) *
                          1.7320508);
    for (int ci = 0; ci < n_c; ci++)
        for (int bi = 0; bi < n_b; bi++) {
            int L = ctxs[ci], B = batches[bi];
            int per_seq = (L + n_var * n_outs * (steps + 3) + bs) / bs + 1;
            pd_kv_cache *kv = NULL;
            if (pd_kv_cache_init(m, bs, B * per_seq, &kv, &err) != PD_OK) {
                printf("| %d | %d | - | %s |\n", L, B, err.msg);
                continue;
            }
            size_t total = (size_t)B * per_seq * pd_kv_cache_block_bytes(kv);
            char *base = pd_kv_cache_block_ptr(kv, 0);
            for (size_t off = 0; off < total; off += chunk_bytes)
                be->ops->upload(be, base + off, fill,
                                total - off < chunk_bytes ? total - off : chunk_bytes);
            pd_seq_kv *seqs = calloc(B, sizeof *seqs);
            pd_batch_seq *batch = calloc(B, sizeof *batch);
            int32_t *tok = malloc((size_t)B * sizeof(int32_t));
            for (int s = 0; s < B; s++) {
                if (pd_seq_kv_reserve(kv, &seqs[s], L) != PD_OK) {
                    fprintf(stderr, "reserve failed\n");
                    return 1;
                }
                seqs[s].num_tokens = L; /* as if prefilled: the cache holds random latents */
            }
            double wbytes, kvbytes;
            for (int vo = 0; vo < n_var * n_outs; vo++) {
                const int vi = vo / n_outs, om = outs[vo % n_outs];
                for (int s = 0; s < B; s++) /* every row from context L (its blocks stay reserved) */
                    seqs[s].num_tokens = L;
                for (int r = 0; r < tp; r++)
                    pd_backend_cuda_set_features(bes[r], &vars[vi].f);
                float *lg = om == OUT_PINNED ? logits_pinned : logits;
                pd_fwd_out fo = {.logits = lg};
                if (om == OUT_SAMPLED || om == OUT_TOP_P) /* no row downloaded */
                    fo = (pd_fwd_out){.logits = lg, .download_row = no_rows, .n_sample = B,
                                      .sample = om == OUT_TOP_P ? trows : srows, .toks = NULL, .n_toks = 0,
                                      .sampled = sout};
                double t[256];
                for (int it = 0; it < steps + 3; it++) {
                    for (int s = 0; s < B; s++) {
                        if (pd_seq_kv_reserve(kv, &seqs[s], 1) != PD_OK) {
                            fprintf(stderr, "reserve failed\n");
                            return 1;
                        }
                        tok[s] = (int32_t)(rnd_u64() % (uint64_t)V);
                        batch[s] = (pd_batch_seq){.kv = &seqs[s], .tokens = &tok[s], .n_tokens = 1};
                    }
                    /* the last step marked for tests/gpu/cupti_trace.c (no-ops without a profiler) */
                    if (it == steps + 2)
                        cudaProfilerStart();
                    double a = now_s();
                    if (pd_model_forward_ex(m, kv, batch, B, &fo, &err) != PD_OK) {
                        fprintf(stderr, "forward: %s\n", err.msg);
                        return 1;
                    }
                    double b = now_s();
                    if (it == steps + 2)
                        cudaProfilerStop();
                    if (it >= 3)
                        t[it - 3] = b - a;
                }
                for (int r = 0; r < tp; r++)
                    if (pd_backend_cuda_status(bes[r], &e2) != PD_OK) {
                        fprintf(stderr, "bench_step: backend error, rank %d: %s\n", r, e2.msg);
                        return 1;
                    }
                bool finite = true; /* sampled: every token a vocabulary id */
                const bool smp = om == OUT_SAMPLED || om == OUT_TOP_P;
                for (int i = 0; i < (smp ? B : V) && finite; i++)
                    finite = smp ? sout[i].token >= 0 && sout[i].token < V : isfinite(lg[i]);
                qsort(t, steps, sizeof t[0], cmp_d);
                double med = t[steps / 2];
                char vname[160];
                snprintf(vname, sizeof vname, "%s%s%s", vars[vi].name, n_outs > 1 || om != OUT_PAGEABLE ? "; " : "",
                         n_outs > 1 || om != OUT_PAGEABLE ? out_names[om] : "");
                double bytes = step_bytes(c, B, L + steps / 2, &wbytes, &kvbytes);
                printf("| %d | %d | %s | %.3f | %.3f | %.0f | %.2f + %.2f | %.0f | %.1f%% |%s\n", L,
                       B, vname, med * 1e3, t[0] * 1e3, B / med, wbytes / 1e9,
                       kvbytes / 1e9, bytes / med / 1e9, 100.0 * bytes / med / bw,
                       finite ? "" : smp ? " (a token out of range!)" : " (logits not finite!)");
                fflush(stdout);
            }
            for (int s = 0; s < B; s++) {
                pd_seq_kv_release(kv, &seqs[s]);
                free(seqs[s].block_table);
            }
            free(seqs);
            free(batch);
            free(tok);
            pd_kv_cache_free(&kv);
        }
    pd_cuda_features on = {true, true, true, true, 0};
    for (int r = 0; r < tp; r++)
        pd_backend_cuda_set_features(bes[r], &on);
    free(fill);
    free(logits);
    if (logits_pinned)
        be->ops->host_free(be, logits_pinned);
    free(srows);
    free(trows);
    free(sout);
    free(no_rows);
    pd_model_free(&m);
    for (int r = 0; r < tp; r++)
        pd_backend_free(&bes[r]);
    return 0;
}
