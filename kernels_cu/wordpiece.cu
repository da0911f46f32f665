// WordPiece tokenisation of UTF-8 texts, 1 to 32 threads a text: decode, normalise through the code point
// table, split into words (white space, punctuation), longest-match pieces from the vocabulary trie,
// the post-processor's special tokens, truncation. Tables: ftengine/wordpiece.py; NumPy twin:
// backends/reference/wordpiece.py (same results, flags included).

#define WP_CP_MASK 0x1FFFFFu
#define WP_CLASS_SHIFT 21
#define WP_WORD 0u
#define WP_PUNCT 2u
#define WP_MULTI (1u << 23)
#define WP_LEN_SHIFT 24
#define WP_SENSITIVE (1u << 29)
#define WP_DELETED (1u << 30)
#define WP_MAX_WORD 128
#define WP_MAX_PATTERN 32
#define WP_TRUNCATED 1
#define WP_ON_CPU 2

__device__ __forceinline__ unsigned long long wp_mix(unsigned long long z) {  // wordpiece.mix
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

struct WpTrie {
    const ulonglong2* slots;   // (S,): {node << 21 | code point (all ones: free), child | child's token << 32}
    unsigned long long mask;   // S - 1

    // The child of `node` along `cp` (-1: none); token: the token the child spells (-1: none).
    __device__ __forceinline__ int child(int node, unsigned cp, int& token) const {
        const unsigned long long key = ((unsigned long long)node << 21) | cp;
        unsigned long long slot = wp_mix(key) & mask;
        while (true) {
            const ulonglong2 found = __ldg(slots + slot);
            if (found.x == key) {
                token = (int)(unsigned)(found.y >> 32);
                return (int)(unsigned)found.y;
            }
            if (found.x == ~0ull) return -1;
            slot = (slot + 1) & mask;
        }
    }
};

// Strict UTF-8 (as Python's decoder): the code point at text[p], p advanced; -1 if invalid.
__device__ __forceinline__ int wp_decode(const unsigned char* text, long long& p, long long end) {
    const unsigned b0 = text[p];
    if (b0 < 0x80) { ++p; return (int)b0; }
    int need;
    unsigned cp, lo = 0x80, hi = 0xBF;
    if (b0 >= 0xC2 && b0 <= 0xDF) { need = 1; cp = b0 & 0x1F; }
    else if (b0 >= 0xE0 && b0 <= 0xEF) {
        need = 2; cp = b0 & 0x0F;
        if (b0 == 0xE0) lo = 0xA0;
        if (b0 == 0xED) hi = 0x9F;   // no surrogates
    } else if (b0 >= 0xF0 && b0 <= 0xF4) {
        need = 3; cp = b0 & 0x07;
        if (b0 == 0xF0) lo = 0x90;
        if (b0 == 0xF4) hi = 0x8F;   // nothing past U+10FFFF
    } else return -1;
    if (p + need >= end) return -1;   // the sequence runs past the text
    for (int k = 1; k <= need; ++k) {
        const unsigned b = text[p + k];
        if (b < (k == 1 ? lo : 0x80u) || b > (k == 1 ? hi : 0xBFu)) return -1;
        cp = (cp << 6) | (b & 0x3F);
    }
    p += need + 1;
    return (int)cp;
}

// A text's pieces, matched as its characters arrive: each character takes one step of the trie walk,
// so that the threads of a warp walk together instead of each walking a whole word while the others
// wait. Longest match first, as WordPiece: when the walk from a piece's start can go no further, its
// longest token is the piece and the walk starts again after it. `write` off: the pieces are only
// counted (a segment whose place in the row is not known yet).
struct WpText {
    int* row;            // the text's ids: prefix, pieces, suffix
    int offset;          // where pieces start (the prefix's length)
    int capacity;        // pieces that fit
    bool write;
    int count;           // pieces written (or counted), those of the segments before included
    bool truncated;
    unsigned word[WP_MAX_WORD];
    int pieces[WP_MAX_WORD];
    int wlen;            // the word's characters (max_word + 1: too long)
    int n;               // the word's pieces so far
    int start;           // where the piece being walked starts
    int node;            // the trie node spelling word[start, wlen)
    int best_end, best_id;   // the longest token from `start` so far
    bool bad;            // a part of the word matches no piece: the word is the unknown token

    __device__ void begin(int pieces_before, bool writes) {
        count = pieces_before;
        write = writes;
        truncated = false;
        wlen = n = start = node = 0;
        best_end = best_id = -1;
        bad = false;
    }

    __device__ void add(const WpTrie& trie, unsigned c, int max_word) {
        if (wlen >= max_word) { wlen = max_word + 1; return; }
        word[wlen++] = c;
        if (bad) return;
        step(trie, c, wlen);
        if (node < 0) settle(trie, wlen);
    }

    // The walk takes c, the character before `end`: a token it spells is the longest from `start` yet.
    __device__ __forceinline__ void step(const WpTrie& trie, unsigned c, int end) {
        int token;
        node = trie.child(node, c, token);
        if (node >= 0 && token >= 0) { best_end = end; best_id = token; }
    }

    // The walk from `start` ended before `end`: its longest token is a piece, and the walk goes again
    // from there to `end`, until one is still going at `end` or a part matches no token.
    __device__ void settle(const WpTrie& trie, int end) {
        while (node < 0) {
            if (best_end < 0) { bad = true; return; }
            pieces[n++] = best_id;
            start = best_end;
            best_end = -1;
            node = 1;
            for (int k = start; k < end && node >= 0; ++k) step(trie, word[k], k + 1);
        }
    }

    // The word ends: its last pieces, written while they fit (the unknown token for a word that is
    // too long or has a part that no piece matches).
    __device__ void flush(const WpTrie& trie, int unk, int max_word) {
        if (wlen > 0 && !truncated) {
            if (wlen > max_word) bad = true;
            while (!bad) {
                if (best_end == wlen) { pieces[n++] = best_id; break; }
                node = -1;
                settle(trie, wlen);
            }
            if (bad) { n = 1; pieces[0] = unk; }
            if (!write) count += n;
            for (int k = 0; k < n && write; ++k) {
                if (count == capacity) { truncated = true; break; }
                row[offset + count++] = pieces[k];
            }
        }
        wlen = n = start = node = 0;
        best_end = best_id = -1;
        bad = false;
    }
};

struct WpTables {
    const unsigned* char_map;
    const unsigned* expansions;
    WpTrie trie;
    const int* patterns;
    const int* pattern_offsets;
    int n_patterns;
    unsigned last_chars;
    int unk, max_word, tail;
};

#define WP_NONE 0x7FFFFFFF

// One segment's walk, as far as it goes: `seen` normalised characters; `event`: the characters seen
// before the first code point the CPU must tokenise (a sensitive one, or the last of an added token's
// text), where the walk stops; `stop_at`: once t truncates, the walk stops `tail` characters later
// (checks for an added token begun before). Bad UTF-8 anywhere in the segment sets `invalid`.
struct WpWalk {
    int seen = 0;
    int event = WP_NONE;
    int stop_at = WP_NONE;
    bool invalid = false;

    __device__ void run(WpText& t, const WpTables& tb, const unsigned char* text, long long p, long long end) {
        unsigned ring[WP_MAX_PATTERN];   // the last normalised characters, for the added tokens
        while (p < end && seen < stop_at) {
            const int before = seen;
            const int cp = wp_decode(text, p, end);
            if (cp < 0) { invalid = true; return; }
            const unsigned entry = __ldg(tb.char_map + cp);
            if (entry & WP_SENSITIVE) { event = before; break; }
            if (entry & WP_DELETED) continue;
            const bool multi = entry & WP_MULTI;
            const int m = multi ? (entry >> WP_LEN_SHIFT) & 31 : 1;
            bool hit = false;
            for (int k = 0; k < m && !hit; ++k) {
                const unsigned v = multi ? __ldg(tb.expansions + (entry & WP_CP_MASK) + k) : entry;
                const unsigned c = v & WP_CP_MASK, cls = (v >> WP_CLASS_SHIFT) & 3;
                ring[seen % WP_MAX_PATTERN] = c;
                ++seen;
                for (int j = 0; j < tb.n_patterns && (tb.last_chars >> (c & 31) & 1); ++j) {
                    const int a = tb.pattern_offsets[j], len = tb.pattern_offsets[j + 1] - a;
                    if (len > seen || (unsigned)tb.patterns[a + len - 1] != c) continue;
                    bool same = true;
                    for (int q = 0; q < len - 1 && same; ++q)
                        same = ring[(seen - len + q) % WP_MAX_PATTERN] == (unsigned)tb.patterns[a + q];
                    hit |= same;
                }
                if (hit || t.truncated) continue;   // once truncated only the checks above still run
                if (cls == WP_WORD) {
                    t.add(tb.trie, c, tb.max_word);
                } else {
                    t.flush(tb.trie, tb.unk, tb.max_word);
                    if (cls == WP_PUNCT) {
                        t.add(tb.trie, c, tb.max_word);
                        t.flush(tb.trie, tb.unk, tb.max_word);
                    }
                    if (t.truncated) stop_at = seen + tb.tail;
                }
            }
            if (hit) { event = before; break; }
        }
        while (p < end)   // the rest must still be UTF-8
            if (wp_decode(text, p, end) < 0) { invalid = true; return; }
    }

    // The segment's last word ends with it, unless the walk stopped short or the text goes on past it.
    __device__ void end_word(WpText& t, const WpTables& tb, bool goes_on) const {
        if (!invalid && event == WP_NONE && !goes_on) t.flush(tb.trie, tb.unk, tb.max_word);
    }
};

// Sums and minima over the `seg` lanes of a text (every lane of the warp calls them).
__device__ __forceinline__ int wp_scan(int v, int seg) {   // inclusive
    const int sub = threadIdx.x & (seg - 1);
    for (int d = 1; d < seg; d <<= 1) {
        const int u = __shfl_up_sync(0xFFFFFFFFu, v, d, seg);
        if (sub >= d) v += u;
    }
    return v;
}

__device__ __forceinline__ int wp_min(int v, int seg) {
    for (int d = seg >> 1; d > 0; d >>= 1) v = min(v, __shfl_xor_sync(0xFFFFFFFFu, v, d, seg));
    return v;
}

// texts [starts[i], stops[i]) of `text`; cut[i]: the text goes on past stops[i] (so it is done only if
// truncated before its last word). ids (n, max_length); lengths (n,), flags (n,): WP_TRUNCATED, or
// WP_ON_CPU (length 0) for a text the CPU must tokenise (invalid UTF-8, a sensitive character, an
// added token's normal form among its characters, a cut text not truncated). The checks stop `tail`
// normalised characters after the one that truncated the text (tail: the longest added token's
// length less one), so that the walk is bounded by max_length, not by the text; only the UTF-8
// decoding goes on to the end. last_chars: bit c % 32 set for the last character c of each added
// token (one is looked for only at such a character).
// A warp takes `texts` texts of `seg` lanes each (seg a power of two, texts x seg <= 32): where the
// texts are too few to fill the device, each is cut after spaces into seg segments of about equal
// bytes, walked side by side (the caller passes seg 1 unless a space is a lone separator that no
// added token holds, so a word or an added token's text never spans two). The first segment writes
// its pieces as it goes; the others count theirs, then, their place known, walk again writing them.
__global__ void wordpiece_tokenize(
    const unsigned char* __restrict__ text, const long long* __restrict__ starts,
    const long long* __restrict__ stops, const unsigned char* __restrict__ cut, int n,
    const unsigned* __restrict__ char_map, const unsigned* __restrict__ expansions,
    const ulonglong2* __restrict__ trie_slots, unsigned long long trie_mask,
    const int* __restrict__ patterns, const int* __restrict__ pattern_offsets, int n_patterns,
    unsigned last_chars, const int* __restrict__ prefix, int n_prefix, const int* __restrict__ suffix,
    int n_suffix, int unk, int max_word, int max_length, int tail, int texts, int seg,
    int* __restrict__ ids, int* __restrict__ lengths, unsigned char* __restrict__ flags) {
    wait_for_previous();
    const int lane = threadIdx.x & 31;
    const int sub = lane & (seg - 1);
    const int i = (blockIdx.x * blockDim.x + threadIdx.x) / 32 * texts + lane / seg;
    const bool live = lane < texts * seg && i < n;   // the other lanes still take part in the sums
    const WpTables tb{char_map, expansions, WpTrie{trie_slots, trie_mask}, patterns, pattern_offsets, n_patterns,
                      last_chars, unk, max_word, tail};
    long long first = 0, end = 0;
    if (live) { first = starts[i]; end = stops[i]; }
    long long to = end;               // this segment's end: just after a space, or the text's end
    if (sub < seg - 1) {
        long long q = first + (end - first) * (sub + 1) / seg;
        while (q < end && text[q] != 0x20) ++q;
        to = q < end ? q + 1 : end;
    }
    long long from = __shfl_up_sync(0xFFFFFFFFu, to, 1, seg);
    if (sub == 0) from = first;
    const bool last = to == end;
    const bool cut_here = live && cut[i];

    WpText t;
    t.row = ids + (long long)(live ? i : 0) * max_length;
    t.offset = n_prefix;
    t.capacity = max_length - n_prefix - n_suffix;
    t.begin(0, sub == 0);
    if (live && sub == 0)
        for (int k = 0; k < n_prefix; ++k) t.row[k] = prefix[k];
    WpWalk w;
    if (live) w.run(t, tb, text, from, to);
    w.end_word(t, tb, last && cut_here);
    const int counted = t.count;
    const int seen_before = wp_scan(w.seen, seg) - w.seen;
    const int pieces_before = wp_scan(counted, seg) - counted;
    const bool first_truncated = __shfl_sync(0xFFFFFFFFu, (int)t.truncated, 0, seg);
    int stop_at = sub == 0 ? w.stop_at : WP_NONE;
    bool truncated = sub == 0 && t.truncated;
    if (live && sub > 0 && !first_truncated && pieces_before <= t.capacity) {
        t.begin(pieces_before, true);
        WpWalk again;
        again.run(t, tb, text, from, to);
        again.end_word(t, tb, last && cut_here);
        truncated = t.truncated;
        if (again.stop_at != WP_NONE) stop_at = seen_before + again.stop_at;
    }
    const int event = wp_min(w.event == WP_NONE ? WP_NONE : seen_before + w.event, seg);
    stop_at = wp_min(stop_at, seg);
    const bool any_truncated = wp_min(truncated ? 0 : 1, seg) == 0;
    const bool invalid = wp_min(w.invalid ? 0 : 1, seg) == 0;
    const int total = __shfl_sync(0xFFFFFFFFu, pieces_before + counted, seg - 1, seg);
    if (!live || sub != 0) return;
    if (invalid || event < stop_at || (cut_here && !any_truncated)) {
        lengths[i] = 0;
        flags[i] = WP_ON_CPU;
        return;
    }
    const int count = any_truncated ? t.capacity : total;
    for (int k = 0; k < n_suffix; ++k) t.row[n_prefix + count + k] = suffix[k];
    lengths[i] = n_prefix + count + n_suffix;
    flags[i] = any_truncated ? WP_TRUNCATED : 0;
}

// out[offsets[i] + j] = ids[i, j] for j < lengths[i]: one block a text.
__global__ void pack_rows(const int* __restrict__ ids, int max_length, const int* __restrict__ lengths,
                          const long long* __restrict__ offsets, int n, int* __restrict__ out) {
    wait_for_previous();
    const int i = blockIdx.x;
    if (i >= n) return;
    const int* row = ids + (long long)i * max_length;
    int* dst = out + offsets[i];
    for (int j = threadIdx.x; j < lengths[i]; j += blockDim.x) dst[j] = row[j];
}
