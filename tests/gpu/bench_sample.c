/* Sampling where the logits are (the CUDA backend's sample_rows) against
 * what a decode replica did before: the logits rows downloaded and sampled
 * one after another by the host sampler (model/sampler.c), in the same run.
 *
 *   bench_sample [--vocab 102400] [--batches 1,8,32,128] [--reps 20]
 *
 * For each batch B and each setting below: B rows of random logits (a
 * normal-ish spread of scale 3, like a model's) in device memory, then
 *   device: sample_rows over the B rows (parameters up, kernel, results
 *           down: the call returns with the tokens on the host);
 *   host:   the B rows downloaded into host memory, then pd_sampler_sample_top
 *           row by row;
 * each timed on the host around the whole of it, the median of --reps after
 * two untimed calls. The logits are uploaded again before every call (the
 * op writes masks, biases and penalties into the rows; untimed). Settings:
 * greedy; temperature 1 with no filter (the whole vocabulary drawn from);
 * temperature 0.7, top-p 0.9; temperature 1, top-k 50, top-p 0.95, min-p
 * 0.05, repetition penalty 1.1 over 300 listed tokens and 5 top logprobs.
 *
 * Built by tests/gpu/build.sh, run by tests/gpu/run.sh sample. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_util.h"
#include "cuda/pd_cuda.h"
#include "pd_model.h"

static uint64_t g_rs = 0x9e3779b97f4a7c15ull;
static double rnd_unit(void) {
    g_rs ^= g_rs << 13;
    g_rs ^= g_rs >> 7;
    g_rs ^= g_rs << 17;
    return (double)(g_rs >> 11) / 9007199254740992.0;
}

typedef struct {
    const char *name;
    pd_sampling_params p;
    int n_seen, n_top;
} setting;

int main(int argc, char **argv) {
    int V = 102400, batches[16] = {1, 8, 32, 128}, n_b = 4, reps = 20;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--vocab") && i + 1 < argc)
            V = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--batches") && i + 1 < argc)
            n_b = parse_list(argv[++i], batches, 16);
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc)
            reps = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: bench_sample [--vocab N] [--batches 1,8,32] [--reps N]\n");
            return 2;
        }
    }
    if (V < 1000 || reps < 1 || reps > 1000) {
        fprintf(stderr, "bench_sample: --vocab >= 1000, --reps in [1, 1000]\n");
        return 2;
    }
    pd_err err = {{0}};
    pd_backend *be = NULL;
    if (pd_backend_cuda_init_ex(0, PD_CUDA_WEIGHTS_BF16, &be, &err) != PD_OK) {
        fprintf(stderr, "bench_sample: %s\n", err.msg);
        return 1;
    }
    struct cudaDeviceProp prop;
    char date[32];
    bench_date_and_gpu(date, &prop);
    printf("# bench_sample %s: %s; vocab %d; median of %d\n\n", date, prop.name, V, reps);

    setting sets[4];
    sets[0] = (setting){"greedy", pd_sampling_defaults(), 0, 0};
    sets[0].p.temperature = 0.0f;
    sets[1] = (setting){"temperature 1, no filter", pd_sampling_defaults(), 0, 0};
    sets[2] = (setting){"temperature 0.7, top-p 0.9", pd_sampling_defaults(), 0, 0};
    sets[2].p.temperature = 0.7f;
    sets[2].p.top_p = 0.9f;
    sets[3] = (setting){"top-k 50, top-p 0.95, min-p 0.05, penalty, 5 logprobs", pd_sampling_defaults(), 300, 5};
    sets[3].p.top_k = 50;
    sets[3].p.top_p = 0.95f;
    sets[3].p.min_p = 0.05f;
    sets[3].p.repetition_penalty = 1.1f;

    int maxB = 0;
    for (int i = 0; i < n_b; i++)
        maxB = batches[i] > maxB ? batches[i] : maxB;
    size_t n_all = (size_t)maxB * V;
    float *h_lg = malloc(n_all * sizeof(float)), *h_dl = malloc(n_all * sizeof(float));
    for (size_t i = 0; i < n_all; i++) { /* sum of three uniforms: a bell of scale ~3 */
        double u = rnd_unit() + rnd_unit() + rnd_unit() - 1.5;
        h_lg[i] = (float)(6.0 * u);
    }
    float *d_lg = be->ops->alloc(be, n_all * sizeof(float));
    int32_t *prompt = malloc(300 * sizeof(int32_t));
    for (int i = 0; i < 300; i++)
        prompt[i] = (int32_t)(rnd_unit() * V);
    pd_sample_row *rows = malloc((size_t)maxB * sizeof *rows);
    pd_sample_out *out = malloc((size_t)maxB * sizeof *out);
    pd_sampler **smp = calloc((size_t)maxB, sizeof *smp);
    double *t = malloc((size_t)reps * sizeof *t);

    printf("| batch | setting | device sample_rows ms | host: download + sampler ms | host / device |\n");
    printf("|---|---|---|---|---|\n");
    for (int bi = 0; bi < n_b; bi++) {
        int B = batches[bi];
        for (int si = 0; si < 4; si++) {
            const setting *S = &sets[si];
            for (int r = 0; r < B; r++) {
                pd_sampling_params p = S->p;
                p.seed = 1000 + (uint64_t)r;
                p.has_seed = true;
                if (pd_sampler_init(&p, V, S->n_seen ? prompt : NULL, S->n_seen, &smp[r], &err) != PD_OK) {
                    fprintf(stderr, "bench_sample: %s\n", err.msg);
                    return 1;
                }
            }
            double td = 0.0, th = 0.0;
            for (int way = 0; way < 2; way++) {
                for (int it = 0; it < reps + 2; it++) {
                    be->ops->upload(be, d_lg, h_lg, (size_t)B * V * sizeof(float));
                    CK(cudaDeviceSynchronize());
                    double t0 = now_s();
                    if (way == 0) {
                        pd_sample_tok *toks = NULL;
                        int n_toks = 0, cap = 0;
                        for (int r = 0; r < B; r++) {
                            rows[r].row = r;
                            pd_sampler_device_row(smp[r], NULL, 0, S->n_top > 0, S->n_top, &rows[r], &toks, &n_toks,
                                                  &cap);
                        }
                        be->ops->sample_rows(be, B, V, d_lg, rows, toks, n_toks, out);
                        for (int r = 0; r < B; r++)
                            pd_sampler_accept(smp[r], out[r].token);
                        free(toks);
                    } else {
                        be->ops->download(be, h_dl, d_lg, (size_t)B * V * sizeof(float));
                        for (int r = 0; r < B; r++) {
                            float lp, tlp[PD_MAX_TOP_LOGPROBS];
                            int32_t tid[PD_MAX_TOP_LOGPROBS];
                            int nt;
                            out[r].token = pd_sampler_sample_top(smp[r], h_dl + (size_t)r * V,
                                                                 S->n_top ? &lp : NULL, S->n_top, tid, tlp, &nt);
                        }
                    }
                    if (it >= 2)
                        t[it - 2] = now_s() - t0;
                }
                pd_err e2 = {{0}};
                if (pd_backend_cuda_status(be, &e2) != PD_OK) {
                    fprintf(stderr, "bench_sample: %s\n", e2.msg);
                    return 1;
                }
                for (int r = 0; r < B; r++)
                    if (out[r].token < 0 || out[r].token >= V) {
                        fprintf(stderr, "bench_sample: row %d: token %d\n", r, out[r].token);
                        return 1;
                    }
                qsort(t, (size_t)reps, sizeof *t, cmp_d);
                if (way == 0)
                    td = t[reps / 2];
                else
                    th = t[reps / 2];
            }
            printf("| %d | %s | %.3f | %.3f | %.1f× |\n", B, S->name, td * 1e3, th * 1e3, th / td);
            fflush(stdout);
            for (int r = 0; r < B; r++)
                pd_sampler_free(&smp[r]);
        }
    }
    be->ops->free(be, d_lg);
    pd_backend_free(&be);
    free(h_lg);
    free(h_dl);
    free(prompt);
    free(rows);
    free(out);
    free(smp);
    free(t);
    return 0;
}
