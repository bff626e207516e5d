/* --debug-replay-tokens: scripted output of a replica (testing); see
 * pd_replay in pd_decode.h. */
#include <jansson.h>
#include <stdlib.h>

#include "pd_decode.h"

void pd_replay_free(pd_replay **r_p) {
    if (!r_p || !*r_p)
        return;
    pd_replay *r = *r_p;
    for (int i = 0; i < r->n_scripts; i++)
        free(r->tokens[i]);
    free(r->tokens);
    free(r->n_tokens);
    free(r);
    *r_p = NULL;
}

static pd_status load_script(const char *path, const json_t *a, size_t k, int vocab_size,
                             pd_replay *r, pd_err *err) {
    size_t n = json_array_size(a), i;
    if (!json_is_array(a) || n > (1u << 20))
        return pd_err_set(err, PD_ERR_FORMAT, "%s: script %zu is not an array of token ids", path,
                          k);
    r->tokens[k] = malloc((n ? n : 1) * sizeof **r->tokens);
    if (!r->tokens[k])
        return pd_err_set(err, PD_ERR_NOMEM, "%s: out of memory", path);
    json_t *v;
    json_array_foreach(a, i, v) {
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= vocab_size)
            return pd_err_set(err, PD_ERR_FORMAT,
                              "%s: script %zu, element %zu is not a token id in [0, %d)", path, k,
                              i, vocab_size);
        r->tokens[k][i] = (int32_t)json_integer_value(v);
    }
    r->n_tokens[k] = (int)n;
    return PD_OK;
}

pd_status pd_replay_load(const char *path, int vocab_size, pd_replay **r_p, pd_err *err) {
    json_error_t je;
    json_t *j = json_load_file(path, 0, &je);
    if (!j)
        return pd_err_set(err, PD_ERR_IO, "%s: %s (line %d)", path, je.text, je.line);
    if (!json_is_array(j) || json_array_size(j) > 4096) {
        json_decref(j);
        return pd_err_set(err, PD_ERR_FORMAT, "%s: not a JSON array of token ids or of scripts",
                          path);
    }
    bool many = json_array_size(j) > 0 && json_is_array(json_array_get(j, 0));
    int n = many ? (int)json_array_size(j) : 1;
    pd_replay *r = calloc(1, sizeof *r);
    if (r) {
        r->tokens = calloc((size_t)n, sizeof *r->tokens);
        r->n_tokens = calloc((size_t)n, sizeof *r->n_tokens);
        r->n_scripts = n;
    }
    if (!r || !r->tokens || !r->n_tokens) {
        pd_replay_free(&r);
        json_decref(j);
        return pd_err_set(err, PD_ERR_NOMEM, "%s: out of memory", path);
    }
    pd_status st = PD_OK;
    for (int k = 0; k < n && st == PD_OK; k++)
        st = load_script(path, many ? json_array_get(j, (size_t)k) : j, (size_t)k, vocab_size, r,
                         err);
    json_decref(j);
    if (st != PD_OK) {
        pd_replay_free(&r);
        return st;
    }
    *r_p = r;
    return PD_OK;
}

const int32_t *pd_replay_script(const pd_replay *r, const pd_sampling_params *sp, int *n_p) {
    int k = sp && sp->has_seed ? (int)(sp->seed % (uint64_t)r->n_scripts) : 0;
    *n_p = r->n_tokens[k];
    return r->tokens[k];
}
