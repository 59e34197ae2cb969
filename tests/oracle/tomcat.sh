#!/usr/bin/env bash
# Runs tests/oracle/OracleServlet.java on Debian's Tomcat 10 (tomcat10, its defaults: the
# package's conf/web.xml and a server.xml with one HTTP/1.1 connector) on 127.0.0.1:PORT, in its
# own CATALINA_BASE under BASE. The servlet has a `<multipart-config/>` with its defaults (no size
# limits), so that the container parses multipart/form-data bodies. The package's service is never used.
#
# usage: tomcat.sh PORT BASE
set -euo pipefail
port=$1 base=$2
here=$(cd "$(dirname "$0")" && pwd)
home=/usr/share/tomcat10
rm -rf "$base" && mkdir -p "$base"/{conf,logs,temp,work,webapps/ROOT/WEB-INF/classes}
cp /etc/tomcat10/web.xml /etc/tomcat10/logging.properties "$base/conf/" 2>/dev/null || cp "$home"/etc/web.xml "$base/conf/"
cat > "$base/conf/server.xml" <<XML
<Server port="-1" shutdown="SHUTDOWN">
  <Service name="Catalina">
    <Connector port="$port" address="127.0.0.1" protocol="HTTP/1.1" connectionTimeout="20000"/>
    <Engine name="Catalina" defaultHost="localhost">
      <Host name="localhost" appBase="webapps" unpackWARs="false" autoDeploy="false"/>
    </Engine>
  </Service>
</Server>
XML
cat > "$base/webapps/ROOT/WEB-INF/web.xml" <<XML
<web-app xmlns="https://jakarta.ee/xml/ns/jakartaee" version="6.0">
  <servlet><servlet-name>oracle</servlet-name><servlet-class>OracleServlet</servlet-class><multipart-config/></servlet>
  <servlet-mapping><servlet-name>oracle</servlet-name><url-pattern>/v1/payments</url-pattern></servlet-mapping>
  <servlet-mapping><servlet-name>oracle</servlet-name><url-pattern>/v2/orders/*</url-pattern></servlet-mapping>
  <servlet-mapping><servlet-name>oracle</servlet-name><url-pattern>/__count</url-pattern></servlet-mapping>
</web-app>
XML
javac -nowarn -d "$base/webapps/ROOT/WEB-INF/classes" -cp /usr/share/java/tomcat10-servlet-api.jar "$here/OracleServlet.java"
echo "PORT $port"
export CATALINA_HOME=$home CATALINA_BASE=$base CATALINA_TMPDIR=$base/temp JAVA_OPTS="-Xmx128m -XX:TieredStopAtLevel=1"
exec "$home/bin/catalina.sh" run
