/* pdserve generate: run a model in-process on a prompt (no services).
 * The smoke test and the reference path: chunked prefill, then decode one
 * token at a time with the absorbed MLA form, sampling per request. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pd_cli.h"
#include "pd_model.h"
#include "pd_tokenizer.h"

static void gen_usage(FILE *f) {
    fprintf(f,
            "usage: pdserve generate --model DIR (--prompt TEXT | --prompt-ids 1,2,3) [--chat] [-n N]\n"
            "                        [--temperature T] [--top-p P] [--top-k K] [--min-p P] [--seed S]\n"
            "                        [--ids] [--ignore-eos] [--chunked-prefill-size N] [--block-size N]\n"
            "                        [--device cpu|cuda] [--threads N] [--tensor-parallel-size N]\n"
            "                        [--enable-expert-parallel] [--dump-logits FILE]\n"
            "  --chat      render the prompt as one user turn of the DeepSeek-V3 chat encoding\n"
            "  --ids       print token ids (prompt then completion) instead of text\n"
            "  -n N        maximum new tokens (default 16)\n"
            "  --tensor-parallel-size N  shard the model over N ranks (CUDA: GPUs 0..N-1; CPU: N threads);\n"
            "              N must divide the attention heads and intermediate sizes (default 1)\n"
            "  --enable-expert-parallel  with --tensor-parallel-size N: the routed experts divided whole\n"
            "              over the ranks (rank r holds experts [r*E/N, (r+1)*E/N); N must divide E)\n"
            "              instead of each expert split; attention and shared experts stay tensor parallel\n");
}

static int parse_ids(const char *s, int32_t **ids_p, size_t *n_p) {
    size_t cap = 16, n = 0;
    int32_t *ids = malloc(cap * sizeof *ids);
    const char *p = s;
    while (*p) {
        char *end;
        long v = strtol(p, &end, 10);
        if (end == p) {
            free(ids);
            return -1;
        }
        if (n == cap) ids = realloc(ids, (cap *= 2) * sizeof *ids);
        ids[n++] = (int32_t)v;
        p = end;
        while (*p == ',' || *p == ' ') p++;
    }
    *ids_p = ids;
    *n_p = n;
    return 0;
}

int pd_cmd_generate(int argc, char **argv) {
    const char *model_dir = NULL, *prompt = NULL, *prompt_ids = NULL, *device = "cpu", *dump = NULL;
    bool chat = false, print_ids = false, ignore_eos = false, expert_parallel = false;
    int max_new = 16, chunk = 512, block_size = 64, threads = 0, tp = 1;
    pd_sampling_params sp = pd_sampling_defaults();
    sp.temperature = 0.0f;
    static const struct option opts[] = {
        {"model", required_argument, 0, 'm'}, {"prompt", required_argument, 0, 'p'},
        {"prompt-ids", required_argument, 0, 'I'}, {"chat", no_argument, 0, 'c'},
        {"max-tokens", required_argument, 0, 'n'}, {"temperature", required_argument, 0, 'T'},
        {"top-p", required_argument, 0, 'P'}, {"top-k", required_argument, 0, 'K'},
        {"min-p", required_argument, 0, 'M'}, {"seed", required_argument, 0, 'S'},
        {"ids", no_argument, 0, 'i'}, {"ignore-eos", no_argument, 0, 'e'},
        {"chunked-prefill-size", required_argument, 0, 'C'}, {"block-size", required_argument, 0, 'B'},
        {"device", required_argument, 0, 'd'}, {"threads", required_argument, 0, 't'},
        {"dump-logits", required_argument, 0, 'D'}, {"tensor-parallel-size", required_argument, 0, 'X'},
        {"enable-expert-parallel", no_argument, 0, 'E'}, {"help", no_argument, 0, 'h'}, {0, 0, 0, 0}};
    int ch;
    optind = 1;
    while ((ch = getopt_long(argc, argv, "n:", opts, NULL)) != -1) {
        switch (ch) {
        case 'm': model_dir = optarg; break;
        case 'p': prompt = optarg; break;
        case 'I': prompt_ids = optarg; break;
        case 'c': chat = true; break;
        case 'n': max_new = atoi(optarg); break;
        case 'T': sp.temperature = (float)atof(optarg); break;
        case 'P': sp.top_p = (float)atof(optarg); break;
        case 'K': sp.top_k = atoi(optarg); break;
        case 'M': sp.min_p = (float)atof(optarg); break;
        case 'S': sp.seed = strtoull(optarg, NULL, 10); sp.has_seed = true; break;
        case 'i': print_ids = true; break;
        case 'e': ignore_eos = true; break;
        case 'C': chunk = atoi(optarg); break;
        case 'B': block_size = atoi(optarg); break;
        case 'd': device = optarg; break;
        case 't': threads = atoi(optarg); break;
        case 'D': dump = optarg; break;
        case 'X': tp = atoi(optarg); break;
        case 'E': expert_parallel = true; break;
        case 'h': gen_usage(stdout); return 0;
        default: gen_usage(stderr); return 2;
        }
    }
    if (!model_dir || (!prompt && !prompt_ids) || max_new < 0 || chunk <= 0 || block_size <= 0 || tp < 1 ||
        tp > PD_TP_MAX_RANKS) {
        gen_usage(stderr);
        return 2;
    }
    pd_err err = {{0}};
    int rc = 1;
    pd_backend *bes[PD_TP_MAX_RANKS] = {0};
    pd_model *m = NULL;
    pd_tokenizer *tok = NULL;
    pd_kv_cache *kv = NULL;
    pd_sampler *smp = NULL;
    int32_t *ids = NULL;
    size_t n_ids = 0;
    float *logits = NULL;
    pd_seq_kv seq = {0};
    FILE *dumpf = NULL;

    if (pd_backend_init_tp(device, tp, threads, bes, &err) != PD_OK) {
        fprintf(stderr, "pdserve generate: %s\n", err.msg);
        return 1;
    }
    double t0 = pd_now_s();
    if (pd_model_load_parallel(model_dir, bes, tp, expert_parallel, &m, &err) != PD_OK) {
        fprintf(stderr, "pdserve generate: %s\n", err.msg);
        goto out;
    }
    const pd_model_config *cfg = pd_model_config_of(m);
    double t_load = pd_now_s() - t0;
    char path[4096];
    snprintf(path, sizeof path, "%s/tokenizer.json", model_dir);
    if (pd_tok_load(path, &tok, &err) != PD_OK) {
        fprintf(stderr, "pdserve generate: %s\n", err.msg);
        goto out;
    }
    if (pd_tok_vocab_size(tok) > cfg->vocab_size) {
        fprintf(stderr, "pdserve generate: %s: tokenizer has %d ids, more than the model's vocab_size %d\n", path,
                pd_tok_vocab_size(tok), cfg->vocab_size);
        goto out;
    }
    if (prompt_ids) {
        if (parse_ids(prompt_ids, &ids, &n_ids) != 0 || n_ids == 0) {
            fprintf(stderr, "pdserve generate: --prompt-ids must be comma-separated integers\n");
            goto out;
        }
    } else {
        char *text = NULL;
        if (chat) {
            pd_chat_message msg = {.role = "user", .content = prompt};
            if (pd_chat_render(&msg, 1, true, PD_TOK_DSV3_BOS, &text, &err) != PD_OK) {
                fprintf(stderr, "pdserve generate: %s\n", err.msg);
                goto out;
            }
        } else {
            /* add_bos_token: true in tokenizer_config.json */
            size_t len = strlen(PD_TOK_DSV3_BOS) + strlen(prompt) + 1;
            text = malloc(len);
            snprintf(text, len, "%s%s", PD_TOK_DSV3_BOS, prompt);
        }
        /* The template's special tokens are parsed; with --chat the user's
         * own text went through the template, as a server would do it. */
        pd_status st = pd_tok_encode(tok, text, strlen(text), true, &ids, &n_ids, &err);
        free(text);
        if (st != PD_OK) {
            fprintf(stderr, "pdserve generate: %s\n", err.msg);
            goto out;
        }
    }
    int n_prompt = (int)n_ids;
    if (n_prompt + max_new > cfg->max_position_embeddings) {
        fprintf(stderr, "pdserve generate: prompt (%d tokens) + -n %d exceeds max_position_embeddings %d\n", n_prompt,
                max_new, cfg->max_position_embeddings);
        goto out;
    }
    int blocks = (n_prompt + max_new + block_size - 1) / block_size + 1;
    if (pd_kv_cache_init(m, block_size, blocks, &kv, &err) != PD_OK) {
        fprintf(stderr, "pdserve generate: %s\n", err.msg);
        goto out;
    }
    /* ids with no text are never drawn, as in the service (the gateway sets the same) */
    sp.text_vocab_size = pd_tok_vocab_size(tok) < cfg->vocab_size ? pd_tok_vocab_size(tok) : 0;
    if (pd_sampler_init(&sp, cfg->vocab_size, ids, n_prompt, &smp, &err) != PD_OK) {
        fprintf(stderr, "pdserve generate: %s\n", err.msg);
        goto out;
    }
    logits = malloc((size_t)cfg->vocab_size * sizeof(float));
    ids = realloc(ids, (size_t)(n_prompt + max_new + 1) * sizeof(int32_t));
    if (dump && !(dumpf = fopen(dump, "wb"))) {
        fprintf(stderr, "pdserve generate: %s: cannot create\n", dump);
        goto out;
    }
    if (print_ids) {
        for (int i = 0; i < n_prompt; i++) printf("%s%d", i ? " " : "", ids[i]);
        printf("\n");
    }
    /* chunked prefill */
    double tp0 = pd_now_s();
    for (int done = 0; done < n_prompt;) {
        int n = n_prompt - done < chunk ? n_prompt - done : chunk;
        pd_batch_seq b = {.kv = &seq, .tokens = ids + done, .n_tokens = n, .all_logits = false};
        if (pd_seq_kv_reserve(kv, &seq, n) != PD_OK ||
            pd_model_forward(m, kv, &b, 1, logits, &err) != PD_OK) {
            fprintf(stderr, "pdserve generate: prefill: %s\n", err.msg[0] ? err.msg : "no free KV block");
            goto out;
        }
        done += n;
    }
    double t_prefill = pd_now_s() - tp0;
    pd_detok *dt = pd_detok_new(tok, false);
    int n_gen = 0;
    double td0 = pd_now_s();
    for (; n_gen < max_new; n_gen++) {
        if (dumpf) fwrite(logits, sizeof(float), (size_t)cfg->vocab_size, dumpf);
        int32_t next = pd_sampler_sample(smp, logits, NULL);
        ids[n_prompt + n_gen] = next;
        if (print_ids) {
            printf("%s%d", n_gen ? " " : "", next);
        } else {
            const char *o;
            size_t ol;
            pd_detok_push(dt, next, &o, &ol);
            fwrite(o, 1, ol, stdout);
        }
        fflush(stdout);
        if (next == cfg->eos_token_id && !ignore_eos) {
            n_gen++;
            break;
        }
        if (n_gen + 1 == max_new) {
            n_gen++;
            break;
        }
        pd_batch_seq b = {.kv = &seq, .tokens = &ids[n_prompt + n_gen], .n_tokens = 1, .all_logits = false};
        if (pd_seq_kv_reserve(kv, &seq, 1) != PD_OK || pd_model_forward(m, kv, &b, 1, logits, &err) != PD_OK) {
            fprintf(stderr, "\npdserve generate: decode: %s\n", err.msg[0] ? err.msg : "no free KV block");
            pd_detok_free(&dt);
            goto out;
        }
    }
    double t_decode = pd_now_s() - td0;
    if (!print_ids) {
        const char *o;
        size_t ol;
        pd_detok_flush(dt, &o, &ol);
        fwrite(o, 1, ol, stdout);
    }
    printf("\n");
    fflush(stdout); /* the text before the stats line on stderr, also when both go to one pipe */
    pd_detok_free(&dt);
    fprintf(stderr,
            "pdserve generate: TP %d; load %.2f s; prefill %d tokens in %.3f s (%.1f tok/s); decode %d tokens in "
            "%.3f s (%.2f tok/s)\n",
            tp, t_load, n_prompt, t_prefill, n_prompt / (t_prefill > 0 ? t_prefill : 1e-9), n_gen, t_decode,
            n_gen > 1 ? (n_gen - 1) / (t_decode > 0 ? t_decode : 1e-9) : 0.0);
    rc = 0;
out:
    if (dumpf) fclose(dumpf);
    free(logits);
    free(ids);
    if (kv) pd_seq_kv_release(kv, &seq);
    free(seq.block_table);
    pd_sampler_free(&smp);
    pd_kv_cache_free(&kv);
    pd_tok_free(&tok);
    pd_model_free(&m);
    for (int r = 0; r < tp; r++)
        pd_backend_free(&bes[r]);
    return rc;
}
