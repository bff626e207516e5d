/* prefill/ — the prefill replica: a queue of long prompts, chunked prefill
 * (--chunked-prefill-size tokens per step) into a local paged KV cache, and
 * KV export: after each chunk the blocks it completed are written into the
 * decode replica's reserved blocks over UCX (kvtransfer/), so the transfer
 * of chunk i overlaps the compute of chunk i+1. After the last chunk it
 * samples the first token, flushes the writes, and only then reports
 * KvComplete (first token included) to the gateway.
 *
 * Reservation protocol (kvtransfer/pd_kvtransfer.h): writes go only to the
 * granted blocks and only while the grant's lease lasts; an Abort stops the
 * writes, flushes, and answers KvComplete{aborted} so the decode replica can
 * reuse the quarantined blocks.
 */
#ifndef PD_PREFILL_H
#define PD_PREFILL_H

/** pdserve prefill: the service entry (argv as given after "prefill"). */
int pd_prefill_main(int argc, char **argv);

#endif
