#!/usr/bin/python3
"""Writes src/data/unicode_nfc_tables.h: the Unicode Character Database facts that
Normalization Form C (UAX #15) needs, from Python's unicodedata. Run it again when moving to a
newer Unicode version: /usr/bin/python3 tools/gen_nfc_tables.py

Two sorted arrays, searched with binary search by src/data/unicode_nfc.cpp:
  kNfcChars         every code point with a nonzero canonical combining class, a canonical
                    decomposition (one level, as UnicodeData.txt gives it), or one of the flags
                    below. Code points not listed have class 0, no decomposition, no flags.
  kNfcCompositions  the primary composites: (first, second) -> composite, sorted by the pair.
Hangul syllables are left out of both; they decompose and compose algorithmically (Unicode
3.12). The Hangul vowel and trailing jamo are listed for their flags.

Python's unicodedata does not expose Full_Composition_Exclusion. It is rebuilt here from its
three parts: singletons and non-starter decompositions (read off the decompositions) and the
explicit list of CompositionExclusions.txt, written out below and checked against unicodedata
(a two-character starter decomposition is excluded exactly when NFC does not recompose it).
"""
import os
import sys
import unicodedata

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "src", "model", "unicode_nfc_tables.h")

# CompositionExclusions.txt: script-specific and post composition version exclusions.
EXPLICIT_EXCLUSIONS = (
    list(range(0x0958, 0x0960)) + [0x09DC, 0x09DD, 0x09DF, 0x0A33, 0x0A36, 0x0A59, 0x0A5A, 0x0A5B, 0x0A5E,
                                   0x0B5C, 0x0B5D, 0x0F43, 0x0F4D, 0x0F52, 0x0F57, 0x0F5C, 0x0F69, 0x0F76,
                                   0x0F78, 0x0F93, 0x0F9D, 0x0FA2, 0x0FA7, 0x0FAC, 0x0FB9, 0xFB1D, 0xFB1F] +
    list(range(0xFB2A, 0xFB37)) + list(range(0xFB38, 0xFB3D)) + [0xFB3E, 0xFB40, 0xFB41, 0xFB43, 0xFB44] +
    list(range(0xFB46, 0xFB4F)) +
    [0x2ADC] + list(range(0x1D15E, 0x1D165)) + list(range(0x1D1BB, 0x1D1C1)))

S_BASE, L_BASE, V_BASE, T_BASE = 0xAC00, 0x1100, 0x1161, 0x11A7
L_COUNT, V_COUNT, T_COUNT = 19, 21, 28
S_COUNT = L_COUNT * V_COUNT * T_COUNT

# Flags of kNfcChars (the C++ names are in the header text below).
COMPOSES_BACKWARD = 1  # the second character of some primary composite (NFC_Quick_Check Maybe)
NOT_NFC = 2            # never in NFC: Full_Composition_Exclusion (NFC_Quick_Check No)
NO_BOUNDARY = 4        # NFC may join it with what comes before


def is_hangul_syllable(cp):
    return S_BASE <= cp < S_BASE + S_COUNT


def canonical_decomposition(cp):
    """The one-level canonical mapping of UnicodeData.txt, or None."""
    d = unicodedata.decomposition(chr(cp))
    if not d or d.startswith("<"):
        return None
    return [int(x, 16) for x in d.split()]


def full_decomposition(cp):
    d = canonical_decomposition(cp)
    if d is None:
        return [cp]
    return [c for part in d for c in full_decomposition(part)]


def main():
    ccc, decomposition = {}, {}
    for cp in range(sys.maxunicode + 1):
        if 0xD800 <= cp <= 0xDFFF or is_hangul_syllable(cp):
            continue
        c = unicodedata.combining(chr(cp))
        if c:
            ccc[cp] = c
        d = canonical_decomposition(cp)
        if d is not None:
            assert len(d) in (1, 2), hex(cp)
            decomposition[cp] = d

    excluded = set(EXPLICIT_EXCLUSIONS)
    compositions = {}
    for cp, d in decomposition.items():
        singleton = len(d) == 1
        non_starter = ccc.get(cp, 0) != 0 or ccc.get(d[0], 0) != 0
        recomposes = unicodedata.normalize("NFC", unicodedata.normalize("NFD", chr(cp))) == chr(cp)
        if singleton or non_starter:
            excluded.add(cp)
            assert not recomposes, hex(cp)
            continue
        assert recomposes == (cp not in excluded), f"CompositionExclusions list is stale at U+{cp:04X}"
        if cp not in excluded:
            compositions[(d[0], d[1])] = cp

    flags = {}
    seconds = {second for (_, second) in compositions}
    seconds |= set(range(V_BASE, V_BASE + V_COUNT)) | set(range(T_BASE + 1, T_BASE + T_COUNT))
    for cp in seconds:
        flags[cp] = flags.get(cp, 0) | COMPOSES_BACKWARD
    for cp in excluded:
        flags[cp] = flags.get(cp, 0) | NOT_NFC
    # A character starts a stretch that NFC treats on its own when it is a starter, composes with
    # nothing before it, and so is the first character of its full decomposition.
    for cp in set(ccc) | set(decomposition) | seconds:
        first = full_decomposition(cp)[0]
        if ccc.get(cp, 0) or cp in seconds or ccc.get(first, 0) or first in seconds:
            flags[cp] = flags.get(cp, 0) | NO_BOUNDARY
    assert all(cp >= 0x300 for cp in set(ccc) | set(flags)), "the below-U+0300 fast path needs this"

    rows = []
    for cp in sorted(set(ccc) | set(decomposition) | set(flags)):
        d = ", ".join(f"0x{x:X}" for x in decomposition.get(cp, []))
        rows.append(f"{{0x{cp:X}, {{{d}}}, {ccc.get(cp, 0)}, {flags.get(cp, 0)}}}")
    comp_rows = [f"{{0x{a:X}, 0x{b:X}, 0x{c:X}}}" for (a, b), c in sorted(compositions.items())]

    def block(items, per_line):
        lines = []
        for i in range(0, len(items), per_line):
            lines.append("    " + ", ".join(items[i:i + per_line]) + ",")
        return "\n".join(lines)

    text = f"""// Generated by tools/gen_nfc_tables.py from Unicode {unicodedata.unidata_version} (Python {sys.version.split()[0]} unicodedata); do not edit.
// The facts of Normalization Form C for src/data/unicode_nfc.cpp; see the script for what
// each table holds. Hangul syllables are algorithmic and absent.
#pragma once

#include <cstdint>

namespace strata::model::nfc_tables {{

inline constexpr const char* kUnicodeVersion = "{unicodedata.unidata_version}";

// Flags of NfcChar.
inline constexpr uint8_t kComposesBackward = {COMPOSES_BACKWARD};  // second character of a primary composite
inline constexpr uint8_t kNotNfc = {NOT_NFC};            // Full_Composition_Exclusion: never in NFC
inline constexpr uint8_t kNoBoundary = {NO_BOUNDARY};        // NFC may join it with the text before it

struct NfcChar {{
  uint32_t cp;
  uint32_t decomposition[2];  // canonical, one level: {{}} none, {{x}} a singleton
  uint8_t ccc;                // canonical combining class
  uint8_t flags;
}};

// Sorted by cp; {len(rows)} code points.
inline constexpr NfcChar kNfcChars[] = {{
{block(rows, 3)}
}};

struct NfcComposition {{
  uint32_t first;
  uint32_t second;
  uint32_t composite;
}};

// Primary composites, sorted by (first, second); {len(comp_rows)} pairs.
inline constexpr NfcComposition kNfcCompositions[] = {{
{block(comp_rows, 4)}
}};

}}  // namespace strata::model::nfc_tables
"""
    with open(OUT, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"{OUT}: Unicode {unicodedata.unidata_version}, {len(rows)} characters "
          f"({len(ccc)} with a combining class, {len(decomposition)} with a decomposition), "
          f"{len(comp_rows)} compositions, {len(excluded)} excluded")


if __name__ == "__main__":
    main()
