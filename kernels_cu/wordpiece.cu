// WordPiece tokenisation of UTF-8 texts, one thread a text: decode, normalise through the code point
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
// so that the threads of a warp (each on its own text) walk together instead of each walking a whole
// word while the others wait. Longest match first, as WordPiece: when the walk from a piece's start
// can go no further, its longest token is the piece and the walk starts again after it.
struct WpText {
    int* row;            // the text's ids: prefix, pieces, suffix
    int offset;          // where pieces start (the prefix's length)
    int capacity;        // pieces that fit
    int count = 0;       // pieces written
    bool truncated = false;
    unsigned word[WP_MAX_WORD];
    int pieces[WP_MAX_WORD];
    int wlen = 0;        // the word's characters (max_word + 1: too long)
    int n = 0;           // the word's pieces so far
    int start = 0;       // where the piece being walked starts
    int node = 0;        // the trie node spelling word[start, wlen)
    int best_end = -1, best_id = -1;   // the longest token from `start` so far
    bool bad = false;    // a part of the word matches no piece: the word is the unknown token

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
            for (int k = 0; k < n; ++k) {
                if (count == capacity) { truncated = true; break; }
                row[offset + count++] = pieces[k];
            }
        }
        wlen = n = start = node = 0;
        best_end = best_id = -1;
        bad = false;
    }
};

// texts [starts[i], stops[i]) of `text`; cut[i]: the text goes on past stops[i] (so it is done only if
// truncated before its last word). ids (n, max_length); lengths (n,), flags (n,): WP_TRUNCATED, or
// WP_ON_CPU (length 0) for a text the CPU must tokenise (invalid UTF-8, a sensitive character, an
// added token's normal form among its characters, a cut text not truncated). The checks stop `tail`
// normalised characters after the one that truncated the text (tail: the longest added token's
// length less one), so that a thread's work is bounded by max_length, not by its text; only the
// UTF-8 decoding goes on to the end. last_chars: bit c % 32 set for the last character c of each
// added token (one is looked for only at such a character). The first `lanes` lanes of each warp
// take a text each: fewer than 32 where the texts are few, since a warp's lanes wait for each
// other's branches.
__global__ void wordpiece_tokenize(
    const unsigned char* __restrict__ text, const long long* __restrict__ starts,
    const long long* __restrict__ stops, const unsigned char* __restrict__ cut, int n,
    const unsigned* __restrict__ char_map, const unsigned* __restrict__ expansions,
    const ulonglong2* __restrict__ trie_slots, unsigned long long trie_mask,
    const int* __restrict__ patterns, const int* __restrict__ pattern_offsets, int n_patterns,
    unsigned last_chars, const int* __restrict__ prefix, int n_prefix, const int* __restrict__ suffix,
    int n_suffix, int unk, int max_word, int max_length, int tail, int lanes,
    int* __restrict__ ids, int* __restrict__ lengths, unsigned char* __restrict__ flags) {
    wait_for_previous();
    const int lane = threadIdx.x & 31;
    const int i = (blockIdx.x * blockDim.x + threadIdx.x) / 32 * lanes + lane;
    if (lane >= lanes || i >= n) return;
    const WpTrie trie{trie_slots, trie_mask};
    WpText t;
    t.row = ids + (long long)i * max_length;
    t.offset = n_prefix;
    t.capacity = max_length - n_prefix - n_suffix;
    for (int k = 0; k < n_prefix; ++k) t.row[k] = prefix[k];
    unsigned ring[WP_MAX_PATTERN];   // the last normalised characters, for the added tokens
    int seen = 0;
    int stop_at = 0x7FFFFFFF;        // once truncated: `tail` more characters, for an added token begun before
    bool on_cpu = false;
    long long p = starts[i];
    const long long end = stops[i];
    while (p < end && !on_cpu && seen < stop_at) {
        const int cp = wp_decode(text, p, end);
        if (cp < 0) { on_cpu = true; break; }
        const unsigned entry = __ldg(char_map + cp);
        if (entry & WP_SENSITIVE) { on_cpu = true; break; }
        if (entry & WP_DELETED) continue;
        const bool multi = entry & WP_MULTI;
        const int m = multi ? (entry >> WP_LEN_SHIFT) & 31 : 1;
        for (int k = 0; k < m && !on_cpu; ++k) {
            const unsigned v = multi ? __ldg(expansions + (entry & WP_CP_MASK) + k) : entry;
            const unsigned c = v & WP_CP_MASK, cls = (v >> WP_CLASS_SHIFT) & 3;
            ring[seen % WP_MAX_PATTERN] = c;
            ++seen;
            for (int j = 0; j < n_patterns && (last_chars >> (c & 31) & 1); ++j) {
                const int a = pattern_offsets[j], len = pattern_offsets[j + 1] - a;
                if (len > seen || (unsigned)patterns[a + len - 1] != c) continue;
                bool same = true;
                for (int q = 0; q < len - 1 && same; ++q)
                    same = ring[(seen - len + q) % WP_MAX_PATTERN] == (unsigned)patterns[a + q];
                on_cpu |= same;
            }
            if (on_cpu || t.truncated) continue;   // once truncated only the checks above still run
            if (cls == WP_WORD) {
                t.add(trie, c, max_word);
            } else {
                t.flush(trie, unk, max_word);
                if (cls == WP_PUNCT) {
                    t.add(trie, c, max_word);
                    t.flush(trie, unk, max_word);
                }
                if (t.truncated) stop_at = seen + tail;
            }
        }
    }
    while (!on_cpu && p < end) on_cpu = wp_decode(text, p, end) < 0;   // the rest must still be UTF-8
    if (!on_cpu) {
        if (cut[i]) on_cpu = !t.truncated;   // its last word may go on past the cut
        else t.flush(trie, unk, max_word);
    }
    if (on_cpu) {
        lengths[i] = 0;
        flags[i] = WP_ON_CPU;
        return;
    }
    for (int k = 0; k < n_suffix; ++k) t.row[n_prefix + t.count + k] = suffix[k];
    lengths[i] = n_prefix + t.count + n_suffix;
    flags[i] = t.truncated ? WP_TRUNCATED : 0;
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
