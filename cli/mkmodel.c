/* pdserve mkmodel --preset NAME --seed N --out DIR */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pd_cli.h"
#include "pd_model.h"

static void mk_usage(FILE *f) {
    fprintf(f, "usage: pdserve mkmodel --preset NAME [--seed N] --out DIR [--tokenizer-dir DIR] [--shard-size GB]\n"
               "       [--num-layers N]\n"
               "  presets: tiny, tiny-v2 (CI), small (CPU demo), v2-lite (16B, bf16), v3-layers (FP8)\n"
               "  Writes config.json, model.safetensors (or shards + index), tokenizer.json and\n"
               "  tokenizer_config.json (from --tokenizer-dir, default the build's npm cache).\n"
               "  --num-layers N keeps the preset's shapes with N decoder layers (1 .. the preset's\n"
               "  count; the first layers stay dense as in the preset): a smaller checkpoint for\n"
               "  profiling one layer's kernels.\n");
}

int pd_cmd_mkmodel(int argc, char **argv) {
    const char *preset = NULL, *out = NULL, *tokdir = NULL;
    unsigned long long seed = 0;
    double shard_gb = 5.0;
    long num_layers = 0;
    static const struct option opts[] = {
        {"preset", required_argument, 0, 'p'}, {"seed", required_argument, 0, 's'},
        {"out", required_argument, 0, 'o'},    {"tokenizer-dir", required_argument, 0, 't'},
        {"shard-size", required_argument, 0, 'z'}, {"num-layers", required_argument, 0, 'l'},
        {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0}};
    int ch;
    optind = 1;
    while ((ch = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (ch) {
        case 'p': preset = optarg; break;
        case 's': seed = strtoull(optarg, NULL, 10); break;
        case 'o': out = optarg; break;
        case 't': tokdir = optarg; break;
        case 'z': shard_gb = atof(optarg); break;
        case 'l': {
            char *end = NULL;
            num_layers = strtol(optarg, &end, 10);
            if (!end || *end || num_layers < 1) {
                fprintf(stderr, "pdserve mkmodel: --num-layers: '%s' is not a positive integer\n", optarg);
                return 2;
            }
            break;
        }
        case 'h': mk_usage(stdout); return 0;
        default: mk_usage(stderr); return 2;
        }
    }
    if (!preset || !out) {
        mk_usage(stderr);
        return 2;
    }
    char deftok[4096];
    if (!tokdir) {
        const char *cache = getenv("PD_CACHE_DIR");
        snprintf(deftok, sizeof deftok, "%s/tokenizer-deepseek_v3", cache && *cache ? cache : PD_SOURCE_DIR "/.cache");
        tokdir = deftok;
    }
    pd_err err = {{0}};
    pd_model_config cfg;
    if (pd_preset_config(preset, &cfg, &err) != PD_OK) {
        fprintf(stderr, "pdserve mkmodel: %s\n", err.msg);
        return 1;
    }
    if (num_layers) {
        if (num_layers > cfg.num_hidden_layers) {
            fprintf(stderr, "pdserve mkmodel: --num-layers %ld: preset '%s' has %d layers\n", num_layers, preset,
                    cfg.num_hidden_layers);
            return 2;
        }
        cfg.num_hidden_layers = (int)num_layers;
        if (cfg.first_k_dense_replace > cfg.num_hidden_layers)
            cfg.first_k_dense_replace = cfg.num_hidden_layers;
    }
    size_t shard = shard_gb > 0 ? (size_t)(shard_gb * 1e9) : 0;
    pd_status st = pd_mkmodel_write(&cfg, seed, out, shard, tokdir, &err);
    if (st != PD_OK) {
        fprintf(stderr, "pdserve mkmodel: %s\n", err.msg);
        return 1;
    }
    fprintf(stderr, "pdserve mkmodel: wrote preset '%s' (seed %llu) to %s\n", preset, seed, out);
    return 0;
}
