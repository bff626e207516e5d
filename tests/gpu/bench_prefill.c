/* Prefill time of a whole model on the CUDA backend, against the bf16 GEMM
 * rate measured in the same run (issue 6: "FLOPs ÷ time ÷ measured GEMM
 * rate").
 *
 *   bench_prefill MODEL_DIR [--prompts 1024,8192,32768,131072] [--chunk 8192]
 *                 [--kernel-max 8192] [--variants gemm,flash,kernel] [--repeat N] [--profile]
 *
 * For every prompt length L: one sequence, L random token ids, prefilled in
 * chunks of --chunk tokens (the prefill replica's --chunked-prefill-size)
 * through pd_model_forward, timed on the host around the whole prompt (each
 * call returns after its logits have arrived). Variants of the MLA
 * attention (--variants, a comma list, default all three): the tensor-core
 * GEMM path (pd_cuda_features.mla_prefill_gemm), the fused kernel
 * (mla_prefill_flash) and, up to --kernel-max tokens, the fp32 kernel (the
 * first version's), so that each one's share is measured in the same run. One chunk of the longest prompt runs untimed first
 * (scratch buffers grow, cuBLAS picks kernels); each prompt up to 32K runs
 * --repeat times (default 3) and the median is printed. --profile (for a
 * run under ncu): no ceiling, no warm-up, each prompt once.
 *
 * Model FLOPs of a prompt (what any implementation must do; multiply-add =
 * 2): every token through every projection (q or q_a/q_b, kv_a, kv_b, o),
 * the dense MLPs, per MoE layer the router, the shared experts and top_k
 * routed experts; attention Σ_p (p + 1)·nh·(qd + dv)·2 over positions p of
 * the prompt (causal: half the square); the lm_head for the last token of
 * each chunk (what pd_model_forward computes). Not counted: the up-
 * projection kv_b of the earlier chunks' latents that every later chunk
 * recomputes (the expanded form's price for a latent cache; printed
 * separately as "recompute").
 *
 * The GEMM ceiling: cublasGemmEx bf16 × bf16 → fp32 (CUBLAS_COMPUTE_32F),
 * 8192 × 8192 × 8192, the median of 10 after 3 warm-up runs.
 *
 * Built by tests/gpu/build.sh, run by tests/gpu/run.sh prefill on a GPU
 * host. */
#include <cublas_v2.h>
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

static uint64_t g_rs = 0x9e3779b97f4a7c15ull;
static uint64_t rnd_u64(void) {
    return bench_rnd(&g_rs);
}

/* Model FLOPs of prefilling L tokens in chunks of `chunk` (see the top);
 * *recompute_p: the kv_b up-projections of earlier chunks' latents. */
static double prefill_flops(const pd_model_config *c, int L, int chunk, double *recompute_p) {
    double H = c->hidden_size, nh = c->num_attention_heads, dn = c->qk_nope_head_dim, dr = c->qk_rope_head_dim;
    double dv = c->v_head_dim, kvr = c->kv_lora_rank, qd = dn + dr;
    double attn_w = (c->q_lora_rank > 0 ? c->q_lora_rank * H + nh * qd * c->q_lora_rank : nh * qd * H) +
                    (kvr + dr) * H + nh * (dn + dv) * kvr + H * nh * dv;
    double per_tok = 0; /* multiply-adds of one token through the layers' weights */
    for (int l = 0; l < c->num_hidden_layers; l++) {
        per_tok += attn_w;
        if (pd_config_layer_is_moe(c, l))
            per_tok += c->n_routed_experts * H +
                       3.0 * c->moe_intermediate_size * H * (c->n_shared_experts + c->num_experts_per_tok);
        else
            per_tok += 3.0 * c->intermediate_size * H;
    }
    double n_chunks = ceil((double)L / chunk);
    double attn = (double)L * (L + 1) / 2.0 * nh * (qd + dv) * c->num_hidden_layers;
    double rec = 0;
    for (int s = chunk; s < L; s += chunk) /* chunk starting at s re-projects s earlier latents */
        rec += (double)s * nh * (dn + dv) * kvr * c->num_hidden_layers;
    *recompute_p = 2.0 * rec;
    return 2.0 * ((double)L * per_tok + attn + n_chunks * c->vocab_size * H);
}

/* The bf16 GEMM rate, FLOP/s. */
static double gemm_ceiling(void) {
    const int n = 8192;
    void *a, *b, *d;
    CK(cudaMalloc(&a, (size_t)n * n * 2));
    CK(cudaMalloc(&b, (size_t)n * n * 2));
    CK(cudaMalloc(&d, (size_t)n * n * 4));
    CK(cudaMemset(a, 0x3c, (size_t)n * n * 2)); /* bf16 ~1.1: finite products */
    CK(cudaMemset(b, 0x3c, (size_t)n * n * 2));
    cublasHandle_t h;
    if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) {
        fprintf(stderr, "bench_prefill: cublasCreate failed\n");
        exit(1);
    }
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    const float one = 1.0f, zero = 0.0f;
    double t[10];
    for (int i = 0; i < 13; i++) {
        CK(cudaEventRecord(e0, 0));
        if (cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, n, n, n, &one, a, CUDA_R_16BF, n, b, CUDA_R_16BF, n, &zero, d,
                         CUDA_R_32F, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS) {
            fprintf(stderr, "bench_prefill: cublasGemmEx failed\n");
            exit(1);
        }
        CK(cudaEventRecord(e1, 0));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (i >= 3)
            t[i - 3] = ms * 1e-3;
    }
    qsort(t, 10, sizeof t[0], cmp_d);
    cublasDestroy(h);
    CK(cudaFree(a));
    CK(cudaFree(b));
    CK(cudaFree(d));
    return 2.0 * n * n * (double)n / t[5];
}

/* Prefills L random tokens in chunks; returns seconds, or < 0 on error. */
static double prefill_once(pd_model *m, pd_backend *be, int L, int chunk, float *logits) {
    const int bs = 64;
    pd_err err = {{0}};
    pd_kv_cache *kv = NULL;
    if (pd_kv_cache_init(m, bs, L / bs + 2, &kv, &err) != PD_OK) {
        fprintf(stderr, "bench_prefill: KV cache for %d tokens: %s\n", L, err.msg);
        return -1;
    }
    const pd_model_config *c = pd_model_config_of(m);
    int32_t *tok = malloc((size_t)L * sizeof(int32_t));
    for (int i = 0; i < L; i++)
        tok[i] = (int32_t)(rnd_u64() % (uint64_t)c->vocab_size);
    pd_seq_kv seq = {0};
    double sec = -1;
    double a = now_s();
    for (int p = 0; p < L; p += chunk) {
        int n = L - p < chunk ? L - p : chunk;
        if (pd_seq_kv_reserve(kv, &seq, n) != PD_OK) {
            fprintf(stderr, "bench_prefill: reserve failed at %d\n", p);
            goto out;
        }
        pd_batch_seq b = {.kv = &seq, .tokens = tok + p, .n_tokens = n};
        if (pd_model_forward(m, kv, &b, 1, logits, &err) != PD_OK) {
            fprintf(stderr, "bench_prefill: forward at %d of %d: %s\n", p, L, err.msg);
            goto out;
        }
    }
    sec = now_s() - a;
    if (pd_backend_cuda_status(be, &err) != PD_OK) {
        fprintf(stderr, "bench_prefill: backend: %s\n", err.msg);
        sec = -1;
    }
    for (int i = 0; i < c->vocab_size && sec >= 0; i++)
        if (!isfinite(logits[i])) {
            fprintf(stderr, "bench_prefill: logit %d not finite after %d tokens\n", i, L);
            sec = -1;
        }
out:
    pd_seq_kv_release(kv, &seq);
    free(seq.block_table);
    free(tok);
    pd_kv_cache_free(&kv);
    return sec;
}

int main(int argc, char **argv) {
    const char *dir = NULL;
    int prompts[16] = {1024, 8192, 32768, 131072}, n_p = 4, chunk = 8192, kernel_max = 8192, repeat = 3;
    bool var_on[3] = {true, true, true}; /* gemm, flash, kernel */
    static const char *var_names[3] = {"tensor-core GEMMs", "fused flash kernel", "fp32 kernel"};
    bool profile = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--prompts") && i + 1 < argc)
            n_p = parse_list(argv[++i], prompts, 16);
        else if (!strcmp(argv[i], "--chunk") && i + 1 < argc)
            chunk = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--kernel-max") && i + 1 < argc)
            kernel_max = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--profile"))
            profile = true;
        else if (!strcmp(argv[i], "--repeat") && i + 1 < argc)
            repeat = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--variants") && i + 1 < argc) {
            const char *v = argv[++i];
            var_on[0] = strstr(v, "gemm") != NULL;
            var_on[1] = strstr(v, "flash") != NULL;
            var_on[2] = strstr(v, "kernel") != NULL;
        }
        else
            dir = argv[i];
    }
    for (int i = 0; i < n_p; i++)
        if (prompts[i] < 1)
            dir = NULL;
    if (!dir || chunk < 1 || n_p < 1 || repeat < 1 || repeat > 15) {
        fprintf(stderr, "usage: bench_prefill MODEL_DIR [--prompts 1024,8192,32768,131072] [--chunk 8192] "
                        "[--kernel-max 8192] [--variants gemm,flash,kernel] [--repeat N (1..15)] [--profile]\n");
        return 2;
    }
    pd_err err = {{0}};
    pd_backend *be = NULL;
    if (pd_backend_cuda_init_ex(0, PD_CUDA_WEIGHTS_BF16, &be, &err) != PD_OK) {
        fprintf(stderr, "bench_prefill: %s\n", err.msg);
        return 1;
    }
    struct cudaDeviceProp prop;
    char date[32];
    bench_date_and_gpu(date, &prop);
    printf("# bench_prefill %s: %s, %d SMs; model %s; chunks of %d tokens\n\n", date, prop.name,
           prop.multiProcessorCount, dir, chunk);
    if (profile)
        repeat = 1;
    double peak = profile ? 1e15 : gemm_ceiling();
    printf("ceiling: bf16 GEMM 8192^3 (cublasGemmEx, fp32 accumulation): %.1f TFLOP/s\n", peak / 1e12);

    double t0 = now_s();
    pd_model *m = NULL;
    if (pd_model_load(dir, be, &m, &err) != PD_OK) {
        fprintf(stderr, "bench_prefill: %s\n", err.msg);
        return 1;
    }
    printf("model loaded in %.1f s\n\n", now_s() - t0);
    const pd_model_config *c = pd_model_config_of(m);
    float *logits = malloc((size_t)c->vocab_size * sizeof(float));
    pd_cuda_features f = {.graphs = true, .gemv = true, .moe_device = true, .mla_prefill_gemm = true};
    pd_backend_cuda_set_features(be, &f);
    int warm = 0;
    for (int i = 0; i < n_p; i++)
        if (prompts[i] > warm)
            warm = prompts[i];
    if (!profile && prefill_once(m, be, warm < chunk ? warm : chunk, chunk, logits) < 0)
        return 1;
    printf("| prompt tokens | attention | seconds | tok/s | model TFLOP | TFLOP/s | of the GEMM ceiling | recompute "
           "TFLOP |\n|---|---|---|---|---|---|---|---|\n");
    fflush(stdout);
    int rc = 0;
    for (int i = 0; i < n_p; i++)
        for (int v = 0; v < 3; v++) {
            int L = prompts[i];
            if (!var_on[v] || (v == 2 && L > kernel_max))
                continue;
            f.mla_prefill_gemm = v == 0;
            f.mla_prefill_flash = v == 1;
            pd_backend_cuda_set_features(be, &f);
            double rec, fl = prefill_flops(c, L, chunk, &rec);
            double t[15];
            int n_rep = L <= 32768 ? repeat : 1, n_ok = 0;
            for (int r = 0; r < n_rep; r++) {
                /* the last repeat marked for tests/gpu/cupti_trace.c (no-ops without a profiler) */
                if (r == n_rep - 1)
                    cudaProfilerStart();
                double sr = prefill_once(m, be, L, chunk, logits);
                if (r == n_rep - 1)
                    cudaProfilerStop();
                if (sr < 0) {
                    n_ok = 0;
                    break;
                }
                t[n_ok++] = sr;
            }
            qsort(t, n_ok, sizeof t[0], cmp_d);
            double s = n_ok ? t[n_ok / 2] : -1;
            const char *name = var_names[v];
            if (s < 0) {
                printf("| %d | %s | failed | | | | | |\n", L, name);
                rc = 1;
                continue;
            }
            printf("| %d | %s | %.3f | %.0f | %.2f | %.1f | %.1f %% | %.2f |\n", L, name, s, L / s, fl / 1e12,
                   fl / s / 1e12, 100.0 * fl / s / peak, rec / 1e12);
            fflush(stdout);
        }
    free(logits);
    pd_model_free(&m);
    pd_backend_free(&be);
    return rc;
}
