// How paged_attention (attention.cpp) cuts a step into jobs for the threads. Rows whose block tables
// begin with the same blocks (one system prompt behind many requests after prefix-cache hits, n > 1
// samples, beams, a prompt's own rows) share a job, which reads those blocks from memory once for all
// of them. Each row's arithmetic, and its order, is the one it has alone, so its result is the same
// bits whether it shares a job or not (vLLM's cascade attention merges a shared and a private part by
// their log-sum-exp instead, which rounds otherwise). Chapter 1, "A shared prefix, read once".
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

// A step's rows: row t belongs to request req[t] and sees the first n[t] keys of it. Request i's
// q_len new rows are the last q_len of its seq_len tokens, so its row j sees seq_len - q_len + j
// + 1 keys (causal): a decode row sees all seq_len, a prompt's rows one more key each.
struct StepRows { std::vector<int64_t> req, n; };

static inline StepRows step_rows(const int64_t* seq_lens, const int64_t* query_start_loc, int64_t num_reqs) {
  StepRows rows;
  for (int64_t i = 0; i < num_reqs; ++i) {
    const int64_t q_len = query_start_loc[i + 1] - query_start_loc[i];
    for (int64_t j = 0; j < q_len; ++j) {
      rows.req.push_back(i);
      rows.n.push_back(seq_lens[i] - q_len + j + 1);
    }
  }
  return rows;
}

// A job's rows: order[first .. first + count), whose tables all begin with the same `shared` blocks.
struct RowGroup { int64_t first, count, shared; };

// Rows share a job when they share at least this many blocks (one is hardly worth a coarser split of
// the work over the threads), and at most this many rows share one (a job keeps all their scores).
static constexpr int64_t kMinSharedBlocks = 2, kMaxRowsPerGroup = 16;

struct SharedBlocks {
  const StepRows& rows;
  const int64_t* tables;
  int64_t max_blocks, block_size;

  const int64_t* table(int64_t t) const { return tables + rows.req[t] * max_blocks; }
  int64_t blocks(int64_t t) const { return (rows.n[t] + block_size - 1) / block_size; }
  int64_t common(int64_t a, int64_t b) const {        // the blocks rows a and b both begin with
    const int64_t most = std::min(blocks(a), blocks(b));
    if (rows.req[a] == rows.req[b]) return most;      // one request's rows: one table
    int64_t i = 0;
    while (i < most && table(a)[i] == table(b)[i]) ++i;
    return i;
  }
  bool before(int64_t a, int64_t b) const {           // tables in lexicographic order, then row order
    if (rows.req[a] == rows.req[b]) return a < b;     // (a prompt's 2,048 rows: no table compared)
    const int64_t *ta = table(a), *tb = table(b);
    if (std::lexicographical_compare(ta, ta + blocks(a), tb, tb + blocks(b))) return true;
    if (std::lexicographical_compare(tb, tb + blocks(b), ta, ta + blocks(a))) return false;
    return a < b;
  }
};

// The step's rows in `order`, cut into groups: one row each when `share` is off, else rows whose
// tables begin alike side by side (sorted by their tables), in groups of up to `cap` that share at
// least kMinSharedBlocks. cap: about a thread's share of the rows, so that a step whose rows all
// share one prefix still splits over the threads.
static inline std::vector<RowGroup> group_rows(const StepRows& rows, const int64_t* tables, int64_t max_blocks,
                                               int64_t block_size, int64_t threads, bool share,
                                               std::vector<int64_t>& order) {
  const int64_t num_rows = int64_t(rows.n.size());
  order.resize(num_rows);
  for (int64_t t = 0; t < num_rows; ++t) order[t] = t;
  std::vector<RowGroup> groups;
  if (!share) {
    for (int64_t t = 0; t < num_rows; ++t) groups.push_back({t, 1, 0});
    return groups;
  }
  const SharedBlocks S{rows, tables, max_blocks, block_size};
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return S.before(a, b); });
  const int64_t cap = std::clamp<int64_t>((num_rows + threads - 1) / threads, 1, kMaxRowsPerGroup);
  for (int64_t i = 0; i < num_rows;) {
    RowGroup g{i, 1, S.blocks(order[i])};
    while (i + g.count < num_rows && g.count < cap) {
      const int64_t shared = std::min(g.shared, S.common(order[i + g.count - 1], order[i + g.count]));
      if (shared < kMinSharedBlocks) break;
      g.shared = shared;
      ++g.count;
    }
    if (g.count == 1) g.shared = 0;
    groups.push_back(g);
    i += g.count;
  }
  return groups;
}

// cut[k] .. cut[k + 1]: thread k's jobs, by prefix sums of their keys (+ a row's fixed cost), so
// that each thread gets about the same work (a prompt's last rows see many more keys than its first;
// a group of rows is one job, and two groups of a step may be the whole step).
static inline std::vector<int64_t> cut_by_keys(const std::vector<int64_t>& job_keys, int64_t threads) {
  const int64_t jobs = int64_t(job_keys.size());
  std::vector<int64_t> cut(threads + 1, jobs);
  cut[0] = 0;
  int64_t total = 0;
  for (int64_t keys : job_keys) total += keys;
  for (int64_t job = 0, done = 0, k = 1; job < jobs && k < threads; ++job) {
    const int64_t before = done;
    done += job_keys[job];
    for (; k < threads && done * threads >= total * k; ++k) {     // the k-th share ends in this job:
      const bool nearer_before = total * k - before * threads < done * threads - total * k;
      cut[k] = std::max(cut[k - 1], nearer_before ? job : job + 1);   // cut at its nearer end
    }
  }
  return cut;
}

// A step's jobs: its rows in `order`, cut into groups, each group into per_group jobs of
// kv_heads / per_group KV heads; thread k takes jobs cut[k] .. cut[k + 1].
struct StepJobs {
  std::vector<int64_t> order, cut;
  std::vector<RowGroup> groups;
  int64_t per_group = 1, threads = 1, most_rows = 1;        // most_rows: the largest group's
  int64_t jobs() const { return int64_t(groups.size()) * per_group; }
};

// A job is one group of rows and KV heads of them: all heads when each thread has enough rows to
// share (a job then reads its blocks whole), else one head each, so that a step of a few rows still
// splits over the threads.
static constexpr int64_t kRowsPerThreadForWholeRows = 4;

static inline StepJobs step_jobs(const StepRows& rows, const int64_t* tables, int64_t max_blocks, int64_t block_size,
                                 int64_t kv_heads, int64_t max_threads, bool share) {
  StepJobs s;
  s.per_group = int64_t(rows.n.size()) >= kRowsPerThreadForWholeRows * max_threads ? 1 : kv_heads;
  s.groups = group_rows(rows, tables, max_blocks, block_size, max_threads, share, s.order);
  s.threads = std::max<int64_t>(1, std::min(max_threads, s.jobs()));
  std::vector<int64_t> job_keys(s.jobs());
  for (int64_t job = 0; job < s.jobs(); ++job) {
    const RowGroup& g = s.groups[job / s.per_group];
    for (int64_t k = 0; k < g.count; ++k) job_keys[job] += rows.n[s.order[g.first + k]] + 16;
    s.most_rows = std::max(s.most_rows, g.count);
  }
  s.cut = cut_by_keys(job_keys, s.threads);
  return s;
}
