/* pdserve mkmodel --preset NAME --seed N --out DIR */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pd_cli.h"
#include "pd_model.h"

static void mk_usage(FILE *f) {
    fprintf(f, "usage: pdserve mkmodel --preset NAME [--seed N] --out DIR [--tokenizer-dir DIR] [--shard-size GB]\n"
               "  presets: tiny, tiny-v2 (CI), small (CPU demo), v2-lite (16B, bf16), v3-layers (FP8)\n"
               "  Writes config.json, model.safetensors (or shards + index), tokenizer.json and\n"
               "  tokenizer_config.json (from --tokenizer-dir, default the build's npm cache).\n");
}

int pd_cmd_mkmodel(int argc, char **argv) {
    const char *preset = NULL, *out = NULL, *tokdir = NULL;
    unsigned long long seed = 0;
    double shard_gb = 5.0;
    static const struct option opts[] = {
        {"preset", required_argument, 0, 'p'}, {"seed", required_argument, 0, 's'},
        {"out", required_argument, 0, 'o'},    {"tokenizer-dir", required_argument, 0, 't'},
        {"shard-size", required_argument, 0, 'z'}, {"help", no_argument, 0, 'h'},
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
    size_t shard = shard_gb > 0 ? (size_t)(shard_gb * 1e9) : 0;
    pd_status st = pd_mkmodel_write(&cfg, seed, out, shard, tokdir, &err);
    if (st != PD_OK) {
        fprintf(stderr, "pdserve mkmodel: %s\n", err.msg);
        return 1;
    }
    fprintf(stderr, "pdserve mkmodel: wrote preset '%s' (seed %llu) to %s\n", preset, seed, out);
    return 0;
}
