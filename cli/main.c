#include <stdio.h>
#include <string.h>

#include "pd_bench.h"
#include "pd_cli.h"
#include "pd_decode.h"
#include "pd_prefill.h"
#include "pd_router.h"

typedef struct {
    const char *name;
    int (*fn)(int, char **);
    const char *help;
} pd_command;

static const pd_command commands[] = {
    {"generate", pd_cmd_generate, "run a model in-process on a prompt (no services)"},
    {"mkmodel", pd_cmd_mkmodel, "write a random-initialised checkpoint of a preset"},
    {"tokenize", pd_cmd_tokenize, "print token ids of a text (or decode ids)"},
    {"verify", pd_cmd_verify, "check a checkpoint's files, headers, config and SHA-256 (manifest)"},
    {"version", pd_cmd_version, "print the version and build options (--deps: library versions)"},
    {"up", pd_cmd_up, "start a gateway, prefill and decode replicas on this host"},
    {"gateway", pd_gateway_main, "run the HTTP gateway and router"},
    {"prefill", pd_prefill_main, "run one prefill replica (chunked prefill, KV export over UCX)"},
    {"decode", pd_decode_main, "run one decode replica (continuous batching)"},
    {"bench", pd_bench_main, "load-test an OpenAI-compatible server"},
};

static void usage(FILE *f) {
    fprintf(f, "usage: pdserve <command> [options]\n\ncommands:\n");
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        fprintf(f, "  %-10s %s\n", commands[i].name, commands[i].help);
    fprintf(f, "\n`pdserve <command> --help` describes a command's options.\n");
}

int main(int argc, char **argv) {
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    if (!strcmp(argv[1], "--version"))
        return pd_cmd_version(1, argv + 1);
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        if (!strcmp(argv[1], commands[i].name))
            return commands[i].fn(argc - 1, argv + 1);
    fprintf(stderr, "pdserve: unknown command '%s'\n", argv[1]);
    usage(stderr);
    return 2;
}
