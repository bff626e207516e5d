/* The KV staging pool: block-sized slots of host memory through which KV
 * blocks move between a replica's cache and other replicas
 * (../shared/DESIGN.md §6: "staged through a pinned host buffer"). Sized
 * apart from the cache (--kv-staging-blocks), so that a 40 GiB device
 * cache no longer page-locks (and registers with UCX) 40 GiB of host
 * memory. pd_model.h has the contract. */
#include "model_impl.h"

#include <stdlib.h>
#include <string.h>

struct pd_kv_staging {
    pd_backend *be;    /* rank 0's: allocates or page-locks the memory */
    char *base;        /* [num_slots][slot_bytes] */
    size_t slot_bytes; /* one KV block */
    int num_slots;
    bool borrowed;   /* the caller's memory (page-locked here when the backend can) */
    bool registered; /* borrowed and page-locked through be->ops->host_register */
    int *free_list;  /* free slot ids; popped from the end */
    int n_free;
    unsigned char *in_use; /* [num_slots]: catches a slot released twice */
};

/* The slots pd_kv_staging_default_slots gives: this many maximum-length
 * prompts, in at most this many bytes (unless one prompt needs more). */
#define STAGING_DEFAULT_PROMPTS 4
#define STAGING_DEFAULT_BYTES   ((size_t)4 << 30)

int pd_kv_staging_default_slots(const pd_model_config *cfg, int block_size, int num_blocks) {
    PD_ASSERT(block_size > 0 && num_blocks > 0);
    size_t bb = pd_kv_cache_bytes_per_block(cfg, block_size);
    long long one =
        ((long long)(cfg->max_position_embeddings > 0 ? cfg->max_position_embeddings : block_size) +
         block_size - 1) /
        block_size;
    long long n = STAGING_DEFAULT_PROMPTS * one;
    long long by_bytes = bb ? (long long)(STAGING_DEFAULT_BYTES / bb) : n;
    if (by_bytes < one)
        by_bytes = one;
    if (n > by_bytes)
        n = by_bytes;
    if (n > num_blocks)
        n = num_blocks;
    return n < 1 ? 1 : (int)n;
}

pd_status pd_kv_staging_init(pd_kv_cache *kv, int num_slots, void *mem, pd_kv_staging **st_p,
                             pd_err *err) {
    if (num_slots <= 0)
        return pd_err_set(err, PD_ERR_INVALID, "KV staging pool: %d slots must be positive",
                          num_slots);
    pd_backend *be = kv->be;
    size_t bb = pd_kv_cache_block_bytes(kv);
    if ((size_t)num_slots > SIZE_MAX / bb)
        return pd_err_set(err, PD_ERR_LIMIT, "KV staging pool: %d slots of %zu bytes overflow",
                          num_slots, bb);
    size_t bytes = (size_t)num_slots * bb;
    pd_kv_staging *st = pd_xcalloc(1, sizeof *st);
    st->be = be;
    st->slot_bytes = bb;
    st->num_slots = num_slots;
    if (mem) {
        st->borrowed = true;
        st->base = mem;
        if (be->ops->host_register) {
            if (be->ops->host_register(be, mem, bytes) != PD_OK) {
                free(st);
                return pd_err_set(err, PD_ERR_IO, "KV staging pool: cannot page-lock %zu bytes",
                                  bytes);
            }
            st->registered = true;
        } else if (be->ops->host_alloc) {
            free(st);
            return pd_err_set(
                err, PD_ERR_UNSUPPORTED,
                "KV staging pool: this backend cannot page-lock memory it did not allocate");
        }
    } else if (be->ops->host_alloc) {
        st->base = be->ops->host_alloc(be, bytes);
    } else {
        /* a host cache (forced staging, for tests): ordinary memory, page-aligned */
        void *p = NULL;
        st->base = posix_memalign(&p, 4096, bytes) == 0 ? p : NULL;
    }
    if (!st->base) {
        free(st);
        return pd_err_set(err, PD_ERR_NOMEM,
                          "KV staging pool: cannot allocate %zu bytes (%d slots) of %shost memory",
                          bytes, num_slots, be->ops->host_alloc ? "page-locked " : "");
    }
    st->free_list = pd_xmalloc((size_t)num_slots * sizeof *st->free_list);
    st->in_use = pd_xcalloc((size_t)num_slots, 1);
    for (int i = 0; i < num_slots; i++)
        st->free_list[i] = num_slots - 1 - i; /* slot 0 first */
    st->n_free = num_slots;
    *st_p = st;
    return PD_OK;
}

void pd_kv_staging_free(pd_kv_staging **st_p) {
    if (!st_p || !*st_p)
        return;
    pd_kv_staging *st = *st_p;
    if (st->registered)
        st->be->ops->host_unregister(st->be, st->base);
    else if (!st->borrowed && st->be->ops->host_alloc)
        st->be->ops->host_free(st->be, st->base);
    else if (!st->borrowed)
        free(st->base);
    free(st->free_list);
    free(st->in_use);
    free(st);
    *st_p = NULL;
}

void *pd_kv_staging_base(const pd_kv_staging *st) {
    return st->base;
}
size_t pd_kv_staging_bytes(const pd_kv_staging *st) {
    return (size_t)st->num_slots * st->slot_bytes;
}
int pd_kv_staging_num_slots(const pd_kv_staging *st) {
    return st->num_slots;
}
int pd_kv_staging_num_free(const pd_kv_staging *st) {
    return st->n_free;
}

void *pd_kv_staging_slot_ptr(pd_kv_staging *st, int slot) {
    PD_ASSERT(slot >= 0 && slot < st->num_slots);
    return st->base + (size_t)slot * st->slot_bytes;
}

pd_status pd_kv_staging_alloc(pd_kv_staging *st, int n, int *slots) {
    if (n < 0 || n > st->n_free)
        return PD_ERR_LIMIT;
    for (int i = 0; i < n; i++) {
        slots[i] = st->free_list[--st->n_free];
        st->in_use[slots[i]] = 1;
    }
    return PD_OK;
}

void pd_kv_staging_release(pd_kv_staging *st, const int *slots, int n) {
    for (int i = 0; i < n; i++) {
        PD_ASSERT(slots[i] >= 0 && slots[i] < st->num_slots && st->in_use[slots[i]]);
        st->in_use[slots[i]] = 0;
        st->free_list[st->n_free++] = slots[i];
    }
}

/* ---- moving blocks between the cache and the staging pool ---- */

typedef struct {
    pd_kv_cache *kv;
    pd_kv_staging *st; /* NULL: the cache (rank 0's, host memory) is the pool */
    const int *blocks, *slots;
    int n;
    bool in; /* pool → cache (else cache → pool) */
} stage_job;

/* Rank `rank`'s part. Out: rank 0's copy of each block to its slot (every
 * rank's copy is the same). In: each slot to every rank's copy; without a
 * staging pool, rank 0's blocks (where the writer put them) to the other
 * ranks' copies. Runs of consecutive blocks (and slots) move as one copy. */
static void stage_on_rank(void *arg, int rank) {
    stage_job *j = arg;
    pd_kv_cache *kv = j->kv;
    if (j->in ? (!j->st && rank == 0) : rank != 0)
        return;
    pd_backend *be = kv->m->ranks[rank].be;
    size_t bb = pd_kv_cache_block_bytes(kv);
    for (int i = 0, e; i < j->n; i = e) {
        for (e = i + 1; e < j->n && j->blocks[e] == j->blocks[e - 1] + 1 &&
                        (!j->st || j->slots[e] == j->slots[e - 1] + 1);
             e++)
            ;
        size_t bytes = (size_t)(e - i) * bb;
        char *d = (char *)kv->rank_data[rank] + (size_t)j->blocks[i] * bb;
        if (!j->st)
            be->ops->copy(be, d, (const char *)kv->data + (size_t)j->blocks[i] * bb, bytes);
        else if (j->in)
            be->ops->upload(be, d, pd_kv_staging_slot_ptr(j->st, j->slots[i]), bytes);
        else
            be->ops->download(be, pd_kv_staging_slot_ptr(j->st, j->slots[i]), d, bytes);
    }
}

static pd_status stage(pd_kv_cache *kv, pd_kv_staging *st, const int *blocks, const int *slots,
                       int n, bool in, pd_err *err) {
    if (!st && kv->be->ops->host_alloc)
        return pd_err_set(err, PD_ERR_INVALID,
                          "KV cache: device memory moves through a staging pool (none given)");
    if (st && (!slots || st->slot_bytes != pd_kv_cache_block_bytes(kv)))
        return pd_err_set(err, PD_ERR_INVALID, "KV cache: %s",
                          !slots ? "no slots given" : "staging slots of another size");
    for (int i = 0; i < n; i++) {
        if (blocks[i] < 0 || blocks[i] >= kv->num_blocks)
            return pd_err_set(err, PD_ERR_INVALID,
                              "KV cache: block %d outside the cache (%d blocks)", blocks[i],
                              kv->num_blocks);
        if (st && (slots[i] < 0 || slots[i] >= st->num_slots))
            return pd_err_set(err, PD_ERR_INVALID,
                              "KV staging pool: slot %d outside the pool (%d slots)", slots[i],
                              st->num_slots);
    }
    if (n <= 0 || (!st && (!in || kv->m->n_ranks == 1)))
        return PD_OK; /* nothing to copy: the cache is the only copy */
    stage_job j = {.kv = kv, .st = st, .blocks = blocks, .slots = slots, .n = n, .in = in};
    pd_tp_run(kv->m->team, kv->m->n_ranks, stage_on_rank, &j);
    return PD_OK;
}

pd_status pd_kv_cache_stage_out(pd_kv_cache *kv, pd_kv_staging *st, const int *blocks,
                                const int *slots, int n, pd_err *err) {
    return stage(kv, st, blocks, slots, n, false, err);
}

pd_status pd_kv_cache_stage_in(pd_kv_cache *kv, pd_kv_staging *st, const int *slots,
                               const int *blocks, int n, pd_err *err) {
    return stage(kv, st, blocks, slots, n, true, err);
}
