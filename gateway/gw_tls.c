/* TLS for the gateway's port: one SSL_CTX per server (OpenSSL 3), one SSL
 * per connection inside libevent's OpenSSL bufferevent, so that everything
 * above the bufferevent is the same as in cleartext.
 *
 * ALPN (RFC 7301) picks the protocol: h2 when the client offers it, else
 * http/1.1 (nghttpx and h2o prefer h2 the same way). A client that offers
 * neither gets no ALPN answer and the first bytes decide, as in cleartext
 * (an HTTP/2 preface → h2 by prior knowledge). `Upgrade: h2c` is not
 * honoured under TLS (RFC 7540 §3.3: h2c is the cleartext form).
 */
#include <string.h>

#include <event2/bufferevent_ssl.h>
#include <openssl/err.h>
#include <openssl/ssl.h>

#include "gw_internal.h"

/* Wire format: length-prefixed names, in our order of preference. */
static const unsigned char gw_alpn_protos[] = "\x02h2\x08http/1.1";

static int alpn_select_cb(SSL *ssl, const unsigned char **out, unsigned char *outlen,
                          const unsigned char *in, unsigned int inlen, void *arg) {
    unsigned char *sel = NULL;
    if (SSL_select_next_proto(&sel, outlen, gw_alpn_protos, sizeof gw_alpn_protos - 1, in, inlen) !=
        OPENSSL_NPN_NEGOTIATED)
        return SSL_TLSEXT_ERR_NOACK;
    *out = sel;
    return SSL_TLSEXT_ERR_OK;
}

/* The most recent OpenSSL error as text (empties the queue). */
static const char *ssl_reason(char *buf, size_t n) {
    unsigned long e = ERR_peek_last_error();
    if (!e)
        snprintf(buf, n, "unknown OpenSSL error");
    else
        ERR_error_string_n(e, buf, n);
    ERR_clear_error();
    return buf;
}

pd_status gw_tls_init(gw_server *s, pd_err *err) {
    char why[256];
    ERR_clear_error();
    SSL_CTX *ctx = SSL_CTX_new(TLS_server_method());
    if (!ctx)
        return pd_err_set(err, PD_ERR_NOMEM, "gateway: SSL_CTX_new: %s",
                          ssl_reason(why, sizeof why));
    /* TLS 1.2 at least (RFC 9113 §9.2); no compression, no renegotiation. */
    SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION);
    SSL_CTX_set_options(ctx, SSL_OP_NO_COMPRESSION | SSL_OP_NO_RENEGOTIATION |
                                 SSL_OP_CIPHER_SERVER_PREFERENCE);
    SSL_CTX_set_mode(ctx, SSL_MODE_RELEASE_BUFFERS);
    if (SSL_CTX_use_certificate_chain_file(ctx, s->cfg.ssl_certfile) != 1) {
        pd_status rc = pd_err_set(err, PD_ERR_IO, "gateway: --ssl-certfile %s: %s",
                                  s->cfg.ssl_certfile, ssl_reason(why, sizeof why));
        SSL_CTX_free(ctx);
        return rc;
    }
    if (SSL_CTX_use_PrivateKey_file(ctx, s->cfg.ssl_keyfile, SSL_FILETYPE_PEM) != 1) {
        pd_status rc = pd_err_set(err, PD_ERR_IO, "gateway: --ssl-keyfile %s: %s",
                                  s->cfg.ssl_keyfile, ssl_reason(why, sizeof why));
        SSL_CTX_free(ctx);
        return rc;
    }
    if (SSL_CTX_check_private_key(ctx) != 1) {
        pd_status rc = pd_err_set(
            err, PD_ERR_IO, "gateway: --ssl-keyfile %s does not match --ssl-certfile %s: %s",
            s->cfg.ssl_keyfile, s->cfg.ssl_certfile, ssl_reason(why, sizeof why));
        SSL_CTX_free(ctx);
        return rc;
    }
    SSL_CTX_set_alpn_select_cb(ctx, alpn_select_cb, NULL);
    s->ssl_ctx = ctx;
    return PD_OK;
}

void gw_tls_free(gw_server *s) {
    if (s->ssl_ctx)
        SSL_CTX_free(s->ssl_ctx);
    s->ssl_ctx = NULL;
}

struct bufferevent *gw_tls_bev_new(gw_server *s, evutil_socket_t fd) {
    SSL *ssl = SSL_new(s->ssl_ctx);
    if (!ssl) {
        ERR_clear_error();
        return NULL;
    }
    /* On success the bufferevent owns ssl (BEV_OPT_CLOSE_ON_FREE frees it
     * and closes fd); on failure both are still ours. */
    struct bufferevent *bev = bufferevent_openssl_socket_new(
        s->base, fd, ssl, BUFFEREVENT_SSL_ACCEPTING, BEV_OPT_CLOSE_ON_FREE);
    if (!bev) {
        SSL_free(ssl);
        return NULL;
    }
    /* A client that closes without close_notify is a normal EOF to us. */
    bufferevent_openssl_set_allow_dirty_shutdown(bev, 1);
    return bev;
}

const gw_proto_i *gw_tls_alpn_proto(struct bufferevent *bev) {
    SSL *ssl = bufferevent_openssl_get_ssl(bev);
    const unsigned char *p = NULL;
    unsigned int n = 0;
    if (ssl)
        SSL_get0_alpn_selected(ssl, &p, &n);
    if (n == 2 && memcmp(p, "h2", 2) == 0)
        return &gw_proto_h2;
    if (n == 8 && memcmp(p, "http/1.1", 8) == 0)
        return &gw_proto_http1;
    return NULL;
}
