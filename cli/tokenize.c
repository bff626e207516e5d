/* pdserve tokenize: token ids of a text or a file, or the text of ids;
 * with --bench, the encode throughput over the input. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pd_cli.h"
#include "pd_tokenizer.h"

int pd_cmd_tokenize(int argc, char **argv) {
    const char *tokfile = NULL, *text = NULL, *file = NULL;
    int bench = 0;
    bool no_special = false;
    static const struct option opts[] = {{"tokenizer", required_argument, 0, 't'}, {"text", required_argument, 0, 'x'},
                                         {"file", required_argument, 0, 'f'},      {"bench", required_argument, 0, 'b'},
                                         {"no-special", no_argument, 0, 's'},      {"help", no_argument, 0, 'h'},
                                         {0, 0, 0, 0}};
    int ch;
    optind = 1;
    while ((ch = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (ch) {
        case 't': tokfile = optarg; break;
        case 'x': text = optarg; break;
        case 'f': file = optarg; break;
        case 'b': bench = atoi(optarg); break;
        case 's': no_special = true; break;
        default:
            fprintf(ch == 'h' ? stdout : stderr,
                    "usage: pdserve tokenize --tokenizer tokenizer.json (--text TEXT | --file FILE) [--no-special] "
                    "[--bench REPEATS]\n");
            return ch == 'h' ? 0 : 2;
        }
    }
    if (!tokfile || (!text && !file)) {
        fprintf(stderr, "pdserve tokenize: --tokenizer and --text or --file are required\n");
        return 2;
    }
    pd_err err = {{0}};
    char *buf = NULL;
    size_t len = 0;
    if (file) {
        if (pd_file_read_all(file, &buf, &len, &err) != PD_OK) {
            fprintf(stderr, "pdserve tokenize: %s\n", err.msg);
            return 1;
        }
    } else {
        buf = pd_xstrdup(text);
        len = strlen(buf);
    }
    pd_tokenizer *tok = NULL;
    double t0 = pd_now_s();
    if (pd_tok_load(tokfile, &tok, &err) != PD_OK) {
        fprintf(stderr, "pdserve tokenize: %s\n", err.msg);
        free(buf);
        return 1;
    }
    double t_load = pd_now_s() - t0;
    int32_t *ids = NULL;
    size_t n = 0;
    int reps = bench > 0 ? bench : 1;
    double best = 1e30;
    for (int r = 0; r < reps; r++) {
        free(ids);
        ids = NULL;
        double a = pd_now_s();
        if (pd_tok_encode(tok, buf, len, !no_special, &ids, &n, &err) != PD_OK) {
            fprintf(stderr, "pdserve tokenize: %s\n", err.msg);
            pd_tok_free(&tok);
            free(buf);
            return 1;
        }
        double dtm = pd_now_s() - a;
        if (dtm < best) best = dtm;
    }
    if (bench > 0) {
        printf("{\"bytes\": %zu, \"tokens\": %zu, \"load_s\": %.4f, \"best_encode_s\": %.6f, \"MB_per_s\": %.3f, "
               "\"tokens_per_s\": %.1f}\n",
               len, n, t_load, best, len / best / 1e6, n / best);
    } else {
        for (size_t i = 0; i < n; i++) printf("%s%d", i ? " " : "", ids[i]);
        printf("\n");
    }
    free(ids);
    pd_tok_free(&tok);
    free(buf);
    return 0;
}
