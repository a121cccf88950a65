/* Shared-memory collectives for the ranks of one host (strata/model/parallel/shm.py wraps them).

   One segment per group, created by one process (shm_create) and mapped by every rank
   (shm_attach). Layout: a header (magic, sizes, each rank's pid, an abort word), one counter per
   rank (`arrive`), one (sent, done) pair per ordered pair of ranks, the broadcast counters (one
   `bsent`, one `bdone` per rank), then the buffers: per parity (generation & 1) one slot per
   rank, a ring of `depth` broadcast slots, and per ordered pair a ring of `depth` channel
   buffers. Every counter sits on its own 128-byte line.

   Collectives are numbered by a per-rank generation g (every rank runs the same collectives in
   the same order). arrive[r] = g means rank r wrote its part of collective g and finished
   reading everything of g - 1. Before writing the buffers of parity g & 1 a rank waits until
   every rank arrived at g - 1 (so nobody still reads g - 2, the last user of that parity); then
   it writes, publishes arrive = g (release) and, where it reads others' parts, waits until every
   rank arrived at g (acquire). all_reduce sums the slots in rank order 0, 1, ..., W - 1 on every
   rank, so all ranks get bit-identical sums; bf16 is summed in float32 and rounded once.
   Messages larger than a slot go in slot-sized chunks, one generation each.

   Broadcasts and point-to-point messages are rings numbered by their own sequences, `depth`
   deep: a root may run `depth` broadcasts ahead of the slowest reader, a sender `depth` messages
   ahead of its receiver. This is what lets pipeline parallel keep P batches in flight: rank 0
   broadcasts batch k + P - 1 while the last stage still works on batch k (the world group of a
   P-stage instance is P + 1 deep).

   Every wait spins briefly (pause), then yields (ranks may outnumber cores, or a peer may share
   our core), then sleeps with a growing interval (an idle worker waiting for the next step
   costs nothing; a collective's interval stays short, since its peer is computing). It gives
   up on a timeout, when the abort word is set, or when a peer it waits for is dead: every
   50 ms it checks the peers' pids (kill(pid, 0), and /proc/PID/stat for a zombie). The rank
   that sees a failure sets the abort word, so every other rank stops at its next wait. */

#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <immintrin.h>
#define CPU_PAUSE() _mm_pause()
#else
#define CPU_PAUSE() ((void)0)
#endif

#define MAGIC 0x5354524154413031ull /* "STRATA01" */
#define LINE 128
#define MAX_WORLD 64
#define HEAD 64            /* bytes before a broadcast or channel payload: the total length */
#define SPIN_NS 2000       /* spin this long before yielding (a peer may share our core) */
#define YIELD_NS 2000000   /* then yield this long before sleeping */
#define CHECK_NS 50000000  /* peer liveness every 50 ms */
#define OK 0
#define ERR_TIMEOUT -1
#define ERR_DEAD -2
#define ERR_ABORTED -3
#define ERR_ARGS -4

typedef struct {
  uint64_t magic, world, buf_bytes, p2p, depth;
  int64_t pids[MAX_WORLD];
} header_t;

typedef struct {
  char *base;
  size_t size;
  int rank, world, failed_rank;
  uint64_t gen, buf, depth, bseq;
  uint64_t send_seq[MAX_WORLD], recv_seq[MAX_WORLD];
} ctx_t;

static size_t align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }
static size_t off_abort(void) { return align_up(sizeof(header_t), LINE); }
static size_t off_arrive(int r) { return off_abort() + LINE * (size_t)(1 + r); }
static size_t off_sent(int w, int s, int d) { return off_arrive(w) + LINE * (size_t)(s * w + d); }
static size_t off_done(int w, int s, int d) { return off_sent(w, w, 0) + LINE * (size_t)(s * w + d); }
static size_t off_bsent(int w) { return off_done(w, w, 0); }
static size_t off_bdone(int w, int r) { return off_bsent(w) + LINE * (size_t)(1 + r); }
static size_t off_bufs(int w) { return align_up(off_bdone(w, w), 4096); }

static size_t segment_size(int w, uint64_t buf, int p2p, uint64_t depth) {
  size_t n = off_bufs(w) + (2 * (size_t)w + depth) * buf;
  return p2p ? n + depth * (size_t)w * w * buf : n;
}

static volatile uint64_t *ctr(const ctx_t *c, size_t off) {
  return (volatile uint64_t *)(c->base + off);
}
static char *slot(const ctx_t *c, uint64_t g, int r) {
  return c->base + off_bufs(c->world) + ((g & 1) * c->world + r) * c->buf;
}
static char *bslot(const ctx_t *c, uint64_t seq) {
  return c->base + off_bufs(c->world) + (2 * (size_t)c->world + seq % c->depth) * c->buf;
}
static char *chan(const ctx_t *c, int s, int d, uint64_t seq) {
  size_t ring = off_bufs(c->world) + (2 * (size_t)c->world + c->depth) * c->buf;
  return c->base + ring + ((size_t)(s * c->world + d) * c->depth + seq % c->depth) * c->buf;
}
static uint64_t load(volatile uint64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static void store(volatile uint64_t *p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static int pid_is_dead(int64_t pid) {
  if (pid <= 0) return 0;
  if (kill((pid_t)pid, 0) == -1 && errno == ESRCH) return 1;
  char path[64], text[512];
  snprintf(path, sizeof path, "/proc/%lld/stat", (long long)pid);
  FILE *f = fopen(path, "r");
  if (!f) return 0;
  size_t n = fread(text, 1, sizeof text - 1, f);
  fclose(f);
  text[n] = 0;
  const char *paren = strrchr(text, ')');  /* "pid (comm) S ...": comm may hold spaces */
  return paren && paren[1] == ' ' && (paren[2] == 'Z' || paren[2] == 'X');
}

static int fail(ctx_t *c, int rank, int code) {
  c->failed_rank = rank;
  uint64_t expected = 0;
  __atomic_compare_exchange_n(ctr(c, off_abort()), &expected, (uint64_t)rank + 1, 0,
                              __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
  return code;
}

/* Wait until *counters[i] >= target for every i; peers[i] is the rank that advances it. */
static int wait_ge(ctx_t *c, volatile uint64_t **counters, const int *peers, int n,
                   uint64_t target, int64_t timeout_ns) {
  const header_t *h = (const header_t *)c->base;
  const int64_t start = now_ns();
  int64_t next_check = start + CHECK_NS, sleep_ns = 10000;
  for (;;) {
    int pending = -1;
    for (int i = 0; i < n; i++)
      if (load(counters[i]) < target) { pending = i; break; }
    if (pending < 0) return OK;
    const uint64_t aborted = load(ctr(c, off_abort()));
    if (aborted) { c->failed_rank = (int)aborted - 1; return ERR_ABORTED; }
    const int64_t now = now_ns(), waited = now - start;
    if (now >= next_check) {
      for (int i = 0; i < n; i++)
        if (load(counters[i]) < target && pid_is_dead(h->pids[peers[i]]))
          return fail(c, peers[i], ERR_DEAD);
      next_check = now + CHECK_NS;
    }
    if (timeout_ns >= 0 && waited > timeout_ns) return fail(c, peers[pending], ERR_TIMEOUT);
    if (waited < SPIN_NS) {
      for (int k = 0; k < 8; k++) CPU_PAUSE();
    } else if (waited < YIELD_NS) {
      sched_yield();
    } else {  /* an idle wait (no timeout) backs off to 1 ms; a collective to 50 us */
      struct timespec ts = {0, sleep_ns};
      nanosleep(&ts, NULL);
      if (sleep_ns < (timeout_ns < 0 ? 1000000 : 50000)) sleep_ns *= 2;
    }
  }
}

/* Every other rank's arrive counter (or, with `bdone`, its broadcast counter) reaches `target`. */
static int wait_others(ctx_t *c, int bdone, uint64_t target, int64_t timeout_ns) {
  volatile uint64_t *counters[MAX_WORLD];
  int peers[MAX_WORLD], n = 0;
  for (int r = 0; r < c->world; r++)
    if (r != c->rank) {
      counters[n] = ctr(c, bdone ? off_bdone(c->world, r) : off_arrive(r));
      peers[n++] = r;
    }
  return wait_ge(c, counters, peers, n, target, timeout_ns);
}

static int wait_all(ctx_t *c, uint64_t target, int64_t timeout_ns) {
  return wait_others(c, 0, target, timeout_ns);
}

static int wait_one(ctx_t *c, size_t off, int peer, uint64_t target, int64_t timeout_ns) {
  volatile uint64_t *counter = ctr(c, off);
  return wait_ge(c, &counter, &peer, 1, target, timeout_ns);
}

/* --- segment lifetime ------------------------------------------------------------------------ */

int shm_create(const char *name, int world, int64_t buf_bytes, int p2p, int depth) {
  if (world < 1 || world > MAX_WORLD || buf_bytes < 4096 || depth < 2) return ERR_ARGS;
  const int fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) return -errno;
  const size_t size = segment_size(world, (uint64_t)buf_bytes, p2p, (uint64_t)depth);
  if (ftruncate(fd, (off_t)size) != 0) { const int e = errno; close(fd); return -e; }
  header_t *h = mmap(NULL, sizeof(header_t), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (h == MAP_FAILED) return -errno;
  h->world = (uint64_t)world;
  h->buf_bytes = (uint64_t)buf_bytes;
  h->p2p = (uint64_t)p2p;
  h->depth = (uint64_t)depth;
  __atomic_store_n(&h->magic, MAGIC, __ATOMIC_RELEASE);
  munmap(h, sizeof(header_t));
  return OK;
}

void *shm_attach(const char *name, int rank) {
  const int fd = shm_open(name, O_RDWR, 0600);
  if (fd < 0) return NULL;
  struct stat st;
  if (fstat(fd, &st) != 0) { close(fd); return NULL; }
  char *base = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (base == MAP_FAILED) return NULL;
  header_t *h = (header_t *)base;
  if (__atomic_load_n(&h->magic, __ATOMIC_ACQUIRE) != MAGIC || rank < 0 ||
      rank >= (int)h->world) { munmap(base, (size_t)st.st_size); return NULL; }
  ctx_t *c = calloc(1, sizeof(ctx_t));
  c->base = base;
  c->size = (size_t)st.st_size;
  c->rank = rank;
  c->world = (int)h->world;
  c->buf = h->buf_bytes;
  c->depth = h->depth;
  c->failed_rank = -1;
  __atomic_store_n(&h->pids[rank], (int64_t)getpid(), __ATOMIC_RELEASE);
  return c;
}

void shm_detach(ctx_t *c) {
  if (!c) return;
  munmap(c->base, c->size);
  free(c);
}

int shm_failed_rank(const ctx_t *c) { return c->failed_rank; }

/* Declare `rank` failed for the whole group (e.g. a launcher saw its process exit). */
void shm_abort(ctx_t *c, int rank) { fail(c, rank, ERR_ABORTED); }

/* Wait until every rank attached (wrote its pid), up to timeout_ns. */
int shm_wait_attached(ctx_t *c, int64_t timeout_ns) {
  const header_t *h = (const header_t *)c->base;
  const int64_t deadline = now_ns() + timeout_ns;
  for (;;) {
    int missing = -1;
    for (int r = 0; r < c->world; r++)
      if (__atomic_load_n(&h->pids[r], __ATOMIC_ACQUIRE) == 0) { missing = r; break; }
    if (missing < 0) return OK;
    if (load(ctr(c, off_abort()))) return ERR_ABORTED;
    if (now_ns() > deadline) return fail(c, missing, ERR_TIMEOUT);
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
  }
}

/* --- collectives ----------------------------------------------------------------------------- */

int shm_barrier(ctx_t *c, int64_t timeout_ns) {
  const uint64_t g = ++c->gen;
  store(ctr(c, off_arrive(c->rank)), g);
  return wait_all(c, g, timeout_ns);
}

static float ld_bf16(const uint16_t *p, int64_t i) {
  uint32_t u = (uint32_t)p[i] << 16; float f; memcpy(&f, &u, 4); return f; }
static void st_bf16(uint16_t *p, int64_t i, float f) {  /* round to nearest even */
  uint32_t u; memcpy(&u, &f, 4); u += 0x7FFFu + ((u >> 16) & 1u); p[i] = (uint16_t)(u >> 16); }

static void sum_f32(ctx_t *c, uint64_t g, float *out, int64_t n) {
  memcpy(out, slot(c, g, 0), sizeof(float) * (size_t)n);
  for (int r = 1; r < c->world; r++) {
    const float *s = (const float *)slot(c, g, r);
    for (int64_t i = 0; i < n; i++) out[i] += s[i];
  }
}

static void sum_bf16(ctx_t *c, uint64_t g, uint16_t *out, int64_t n) {
  float acc[1024];
  for (int64_t i0 = 0; i0 < n; i0 += 1024) {
    const int64_t m = n - i0 < 1024 ? n - i0 : 1024;
    const uint16_t *s0 = (const uint16_t *)slot(c, g, 0) + i0;
    for (int64_t i = 0; i < m; i++) acc[i] = ld_bf16(s0, i);
    for (int r = 1; r < c->world; r++) {
      const uint16_t *s = (const uint16_t *)slot(c, g, r) + i0;
      for (int64_t i = 0; i < m; i++) acc[i] += ld_bf16(s, i);
    }
    for (int64_t i = 0; i < m; i++) st_bf16(out + i0, i, acc[i]);
  }
}

/* In-place sum of `n` elements (dtype 0: float32, 1: bfloat16) over the group. */
int shm_all_reduce(ctx_t *c, void *data, int64_t n, int dtype, int64_t timeout_ns) {
  const int64_t esz = dtype == 0 ? 4 : 2, per = (int64_t)c->buf / esz;
  for (int64_t off = 0; off < n; off += per) {
    const int64_t m = n - off < per ? n - off : per;
    char *part = (char *)data + off * esz;
    const uint64_t g = ++c->gen;
    int rc = wait_all(c, g - 1, timeout_ns);
    if (rc) return rc;
    memcpy(slot(c, g, c->rank), part, (size_t)(m * esz));
    store(ctr(c, off_arrive(c->rank)), g);
    if ((rc = wait_all(c, g, timeout_ns))) return rc;
    if (dtype == 0) sum_f32(c, g, (float *)part, m);
    else sum_bf16(c, g, (uint16_t *)part, m);
  }
  return OK;
}

/* Rank r holds `rows` rows of row_bytes[r] bytes; the gathered rows concatenate every rank's
   row in rank order (`out`: rows x sum(row_bytes)). root < 0: every rank gets `out`; else only
   root (the others write their part and go on). */
int shm_gather_rows(ctx_t *c, const void *src, int64_t rows, const int64_t *row_bytes,
                    void *out, int root, int64_t timeout_ns) {
  int64_t widest = 1, total = 0;
  for (int r = 0; r < c->world; r++) {
    total += row_bytes[r];
    if (row_bytes[r] > widest) widest = row_bytes[r];
  }
  const int64_t per = (int64_t)c->buf / widest;
  if (per < 1) return ERR_ARGS;
  const int reads = root < 0 || root == c->rank;
  for (int64_t r0 = 0; r0 < rows; r0 += per) {
    const int64_t m = rows - r0 < per ? rows - r0 : per;
    const uint64_t g = ++c->gen;
    int rc = wait_all(c, g - 1, timeout_ns);
    if (rc) return rc;
    memcpy(slot(c, g, c->rank), (const char *)src + r0 * row_bytes[c->rank],
           (size_t)(m * row_bytes[c->rank]));
    store(ctr(c, off_arrive(c->rank)), g);
    if (!reads) continue;
    if ((rc = wait_all(c, g, timeout_ns))) return rc;
    int64_t col = 0;
    for (int r = 0; r < c->world; r++) {
      const char *s = slot(c, g, r);
      for (int64_t i = 0; i < m; i++)
        memcpy((char *)out + (r0 + i) * total + col, s + i * row_bytes[r], (size_t)row_bytes[r]);
      col += row_bytes[r];
    }
  }
  return OK;
}

/* Root: send `len` bytes to every rank. The ring slot of chunk `seq` is free once every other
   rank consumed chunk seq - depth; the root counts its own chunks as consumed, so that any rank
   may be the next root. */
int shm_broadcast_send(ctx_t *c, const void *data, int64_t len, int64_t timeout_ns) {
  const int64_t per = (int64_t)c->buf - HEAD;
  int64_t off = 0;
  do {
    const int64_t m = len - off < per ? len - off : per;
    const uint64_t seq = ++c->bseq;
    if (seq > c->depth) {
      const int rc = wait_others(c, 1, seq - c->depth, timeout_ns);
      if (rc) return rc;
    }
    char *s = bslot(c, seq);
    memcpy(s, &len, sizeof len);
    memcpy(s + HEAD, (const char *)data + off, (size_t)m);
    store(ctr(c, off_bsent(c->world)), seq);
    store(ctr(c, off_bdone(c->world, c->rank)), seq);
    off += m;
  } while (off < len);
  return OK;
}

/* Others: the length of root's next broadcast (waits for it; consumes nothing). */
int64_t shm_broadcast_len(ctx_t *c, int root, int64_t timeout_ns) {
  const int rc = wait_one(c, off_bsent(c->world), root, c->bseq + 1, timeout_ns);
  if (rc) return rc;
  int64_t len;
  memcpy(&len, bslot(c, c->bseq + 1), sizeof len);
  return len;
}

int shm_broadcast_recv(ctx_t *c, int root, void *data, int64_t len, int64_t timeout_ns) {
  const int64_t per = (int64_t)c->buf - HEAD;
  int64_t off = 0;
  do {
    const int64_t m = len - off < per ? len - off : per;
    const uint64_t seq = ++c->bseq;
    const int rc = wait_one(c, off_bsent(c->world), root, seq, timeout_ns);
    if (rc) return rc;
    memcpy((char *)data + off, bslot(c, seq) + HEAD, (size_t)m);
    store(ctr(c, off_bdone(c->world, c->rank)), seq);
    off += m;
  } while (off < len);
  return OK;
}

/* --- point to point (segments created with p2p) ---------------------------------------------- */

int shm_send(ctx_t *c, int dst, const void *data, int64_t len, int64_t timeout_ns) {
  const int64_t per = (int64_t)c->buf - HEAD;
  const int w = c->world, s = c->rank;
  int64_t off = 0;
  do {
    const int64_t m = len - off < per ? len - off : per;
    const uint64_t seq = ++c->send_seq[dst];
    const uint64_t free_at = seq <= c->depth ? 0 : seq - c->depth;
    const int rc = wait_one(c, off_done(w, s, dst), dst, free_at, timeout_ns);
    if (rc) return rc;
    char *b = chan(c, s, dst, seq);
    memcpy(b, &len, sizeof len);
    memcpy(b + HEAD, (const char *)data + off, (size_t)m);
    store(ctr(c, off_sent(w, s, dst)), seq);
    off += m;
  } while (off < len);
  return OK;
}

int64_t shm_recv_len(ctx_t *c, int src, int64_t timeout_ns) {
  const uint64_t seq = c->recv_seq[src] + 1;
  const int rc = wait_one(c, off_sent(c->world, src, c->rank), src, seq, timeout_ns);
  if (rc) return rc;
  int64_t len;
  memcpy(&len, chan(c, src, c->rank, seq), sizeof len);
  return len;
}

int shm_recv(ctx_t *c, int src, void *data, int64_t len, int64_t timeout_ns) {
  const int64_t per = (int64_t)c->buf - HEAD;
  const int w = c->world, d = c->rank;
  int64_t off = 0;
  do {
    const int64_t m = len - off < per ? len - off : per;
    const uint64_t seq = ++c->recv_seq[src];
    const int rc = wait_one(c, off_sent(w, src, d), src, seq, timeout_ns);
    if (rc) return rc;
    memcpy((char *)data + off, chan(c, src, d, seq) + HEAD, (size_t)m);
    store(ctr(c, off_done(w, src, d)), seq);
    off += m;
  } while (off < len);
  return OK;
}
