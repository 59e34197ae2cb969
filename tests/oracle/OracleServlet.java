// The oracle's Java backend (tests/it/boundary_oracle.rs): one servlet on Debian's Tomcat 10 with
// its defaults (tests/oracle/tomcat.sh), mapped to `/v1/payments` and `/v2/orders/*`, the same
// contract as backends.py. The servlet API parses no JSON: a JSON body is reported as the servlet
// reads it (the request's characters), so two bodies are alike here only when their text is. Any
// other body is reported as the form the container parsed (`{"form": {name: [values]}, "files":
// {name: [[filename, sha256 of the content]]}}`); multipart/form-data through the servlet's
// `<multipart-config/>` (tomcat.sh's web.xml, its defaults): text parts in the parameter map,
// parts with a file name as files.
// A body that names a JSON-RPC `method` is answered with what was read as the `result` of a
// JSON-RPC response whose `id` is the request's, found by a pattern (no parser here either).
import jakarta.servlet.http.HttpServlet;
import jakarta.servlet.http.HttpServletRequest;
import jakarta.servlet.ServletException;
import jakarta.servlet.http.HttpServletResponse;
import jakarta.servlet.http.Part;
import java.io.IOException;
import java.security.MessageDigest;
import java.util.LinkedHashMap;
import java.util.ArrayList;
import java.util.Collections;
import java.util.List;
import java.util.Map;
import java.util.concurrent.atomic.AtomicLong;
import java.util.regex.Matcher;
import java.util.regex.Pattern;

public class OracleServlet extends HttpServlet {
    static final AtomicLong COUNT = new AtomicLong();
    static final Pattern METHOD = Pattern.compile("\"method\"\\s*:");
    static final Pattern ID = Pattern.compile("\"id\"\\s*:\\s*(-?[0-9][0-9.eE+-]*|\"[^\"]*\"|null)");

    static String q(String s) {
        if (s == null) return "null";
        StringBuilder b = new StringBuilder("\"");
        for (char c : s.toCharArray()) {
            if (c == '"' || c == '\\') b.append('\\').append(c);
            else if (c < 0x20) b.append(String.format("\\u%04x", (int) c));
            else b.append(c);
        }
        return b.append('"').toString();
    }

    static String all(HttpServletRequest r, String name) {
        List<String> out = new ArrayList<>();
        for (String v : Collections.list(r.getHeaders(name))) out.add(q(v));
        return "[" + String.join(",", out) + "]";
    }

    @Override
    protected void service(HttpServletRequest r, HttpServletResponse w) throws IOException, ServletException {
        if (r.getServletPath().equals("/__count")) {
            w.setContentType("application/json");
            w.getWriter().write("{\"count\": " + COUNT.get() + "}");
            return;
        }
        COUNT.incrementAndGet();
        boolean orders = r.getServletPath().equals("/v2/orders");
        String route = orders ? "orders" : "payments";
        String params = orders ? "{\"id\":" + q(r.getPathInfo() == null ? "" : r.getPathInfo().substring(1)) + "}" : "{}";
        String type = r.getContentType() == null ? "" : r.getContentType().toLowerCase();
        boolean json = type.contains("json");
        String body = json
            ? new String(r.getInputStream().readAllBytes(), r.getCharacterEncoding() == null ? "UTF-8" : r.getCharacterEncoding())
            : "";
        List<String> query = new ArrayList<>();
        // The query as the container parses it (getParameterMap also reads form bodies: with a
        // JSON body only the query string is taken, the body being read above first). Any other
        // body is the form the container parses (a urlencoded POST), which the servlet API hands
        // over merged with the query (query values first): both are reported as that merged map.
        List<String> form = new ArrayList<>();
        for (Map.Entry<String, String[]> e : r.getParameterMap().entrySet()) {
            List<String> vs = new ArrayList<>();
            for (String v : e.getValue()) {
                query.add("[" + q(e.getKey()) + "," + q(v) + "]");
                vs.add(q(v));
            }
            form.add(q(e.getKey()) + ":[" + String.join(",", vs) + "]");
        }
        Collections.sort(query);
        Map<String, List<String>> files = new LinkedHashMap<>();
        if (type.startsWith("multipart/form-data")) {
            for (Part p : r.getParts()) {
                if (p.getSubmittedFileName() == null) continue;
                String sum;
                try {
                    StringBuilder hex = new StringBuilder();
                    for (byte b : MessageDigest.getInstance("SHA-256").digest(p.getInputStream().readAllBytes()))
                        hex.append(String.format("%02x", b));
                    sum = hex.toString();
                } catch (java.security.NoSuchAlgorithmException e) {
                    throw new IOException(e);
                }
                files.computeIfAbsent(p.getName(), k -> new ArrayList<>())
                    .add("[" + q(p.getSubmittedFileName()) + "," + q(sum) + "]");
            }
        }
        List<String> fileFields = new ArrayList<>();
        for (Map.Entry<String, List<String>> e : files.entrySet())
            fileFields.add(q(e.getKey()) + ":[" + String.join(",", e.getValue()) + "]");
        String path = r.getServletPath() + (r.getPathInfo() == null ? "" : r.getPathInfo());
        String host = r.getHeader("host");
        String out = "{\"route\":" + q(route) + ",\"params\":" + params + ",\"method\":" + q(r.getMethod())
            + ",\"path\":" + q(path) + ",\"host\":" + q(host)
            + ",\"authorization\":" + all(r, "authorization") + ",\"x-caller\":" + all(r, "x-caller")
            + ",\"idempotency-key\":" + all(r, "idempotency-key") + ",\"x-op\":" + all(r, "x-op")
            + ",\"query\":[" + String.join(",", query) + "],\"body\":"
            + (json ? q(body) : "{\"form\":{" + String.join(",", form) + "},\"files\":{"
                + String.join(",", fileFields) + "}}") + "}";
        Matcher id = ID.matcher(body);
        if (METHOD.matcher(body).find() && id.find()) {
            out = "{\"jsonrpc\":\"2.0\",\"id\":" + id.group(1) + ",\"result\":" + out + "}";
        }
        w.setStatus(201);
        w.setContentType("application/json");
        w.setCharacterEncoding("UTF-8");
        w.getWriter().write(out);
    }
}
