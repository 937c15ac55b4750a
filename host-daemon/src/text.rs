//! Guest text made safe for a terminal and for line-oriented logs.
//!
//! Engine log lines come out of the VM: before they reach `engine.log` or the operator's
//! terminal, [`terminal_safe`] removes escape sequences (CSI `ESC [ … final`, OSC/DCS/
//! SOS/PM/APC strings up to their terminator, and two-byte `ESC x`), C1 controls
//! (U+0080–U+009F, which some terminals read as `ESC x`) and bidirectional overrides, and
//! turns every other control character (all of U+0000–U+001F, tab and newline included,
//! and U+007F) into a space: one record is one line, whatever it holds, so a record
//! cannot forge a second `[Error]` line.

/// `text` without escape sequences or control characters (see the module docs).
pub fn terminal_safe(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\x1b' => match chars.next() {
                // CSI: parameter and intermediate bytes up to a final byte 0x40..=0x7e.
                Some('[') => {
                    for p in chars.by_ref() {
                        if ('\x40'..='\x7e').contains(&p) {
                            break;
                        }
                    }
                }
                // String commands: up to BEL or ST (`ESC \`).
                Some(']' | 'P' | 'X' | '^' | '_') => {
                    while let Some(p) = chars.next() {
                        if p == '\x07' {
                            break;
                        }
                        if p == '\x1b' {
                            chars.next_if_eq(&'\\');
                            break;
                        }
                    }
                }
                // Two-byte sequences (and a lone ESC at the end).
                _ => {}
            },
            '\u{80}'..='\u{9f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}' => {}
            c if c.is_ascii_control() => out.push(' '),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_escapes_and_controls_never_survive() {
        assert_eq!(terminal_safe("plain text 123"), "plain text 123");
        assert_eq!(terminal_safe("a\n[Error] forged"), "a [Error] forged");
        assert_eq!(terminal_safe("red \x1b[31;1mALERT\x1b[0m"), "red ALERT");
        assert_eq!(terminal_safe("\x1b]0;title\x07after"), "after");
        assert_eq!(terminal_safe("\x1b]8;;http://x\x1b\\link"), "link");
        assert_eq!(terminal_safe("\x1bcreset"), "reset");
        assert_eq!(terminal_safe("tab\there\r\x7f\x00"), "tab here   ");
        assert_eq!(terminal_safe("c1\u{9b}31m"), "c131m");
        assert_eq!(terminal_safe("bidi\u{202e}txt"), "biditxt");
        assert_eq!(terminal_safe("unterminated \x1b["), "unterminated ");
        assert_eq!(terminal_safe("ünïcödé"), "ünïcödé");
        // Whatever goes in, nothing a terminal acts on comes out.
        let all: String = (0u32..0x300).filter_map(char::from_u32).collect();
        let safe = terminal_safe(&all);
        assert!(
            !safe.chars().any(|c| c.is_control() && c != ' '),
            "{safe:?}"
        );
    }
}
