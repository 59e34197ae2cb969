//! What the core sees of a request: its head as the host gave it, every header line kept.

/// The request's pseudo headers and every header line, names lowercase as Envoy delivers them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RequestHead {
    pub method: String,
    /// `:path` as sent, query included.
    pub path: String,
    pub authority: String,
    /// All header lines in order (pseudo headers may be included; they are ignored by `values`).
    pub headers: Vec<(String, Vec<u8>)>,
    /// The request trailers, in order (empty until they arrive, and for requests without any).
    pub trailers: Vec<(String, Vec<u8>)>,
}

impl RequestHead {
    /// Builds a head from the host's full header list (pseudo headers included).
    pub fn from_pairs(pairs: Vec<(String, Vec<u8>)>) -> RequestHead {
        let mut head = RequestHead::default();
        for (name, value) in &pairs {
            let text = || String::from_utf8_lossy(value).into_owned();
            match name.as_str() {
                ":method" => head.method = text(),
                ":path" => head.path = text(),
                ":authority" => head.authority = text(),
                _ => {}
            }
        }
        head.headers = pairs;
        head
    }

    /// Every value of header `name` (lowercase), in order. A header sent on several lines has
    /// several values: the host's single-header read would only return the first.
    pub fn values(&self, name: &str) -> Vec<&[u8]> {
        self.headers.iter().filter(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_slice()).collect()
    }

    /// A head for tests: method, path and header lines.
    #[cfg(test)]
    pub(crate) fn for_test(method: &str, path: &str, headers: &[(&str, &str)]) -> RequestHead {
        let mut pairs =
            vec![(":method".to_string(), method.as_bytes().to_vec()), (":path".to_string(), path.as_bytes().to_vec())];
        pairs.extend(headers.iter().map(|(n, v)| (n.to_string(), v.as_bytes().to_vec())));
        RequestHead::from_pairs(pairs)
    }

    /// The path without its query string.
    pub fn path_without_query(&self) -> &str {
        self.path.split_once('?').map_or(self.path.as_str(), |(p, _)| p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn repeated_header_lines_are_all_returned_in_order() {
        let head = RequestHead::from_pairs(vec![
            (":method".into(), b"POST".to_vec()),
            (":path".into(), b"/pay?x=1".to_vec()),
            ("x-a".into(), b"1".to_vec()),
            ("x-b".into(), b"2".to_vec()),
            ("x-a".into(), b"3".to_vec()),
        ]);
        assert_eq!(head.method, "POST");
        assert_eq!(head.values("x-a"), vec![b"1".as_slice(), b"3".as_slice()]);
        assert!(head.values("x-c").is_empty());
        assert_eq!(head.path_without_query(), "/pay");
    }
}
